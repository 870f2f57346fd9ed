"""Checkpoint inputs offloaded to pinned host memory between forward and backward (``apply(offload=True)``).

``offloader`` wires autograd's saved-tensor hooks around every non-reentrant checkpoint; ``policy`` decides what
is kept on the device, ``handles`` are what pack returns, ``copier`` moves the bytes, ``restore`` brings them back
in any order, ``window`` accounts per optimizer step, ``pinned_pool`` owns the host buffers and ``probes`` names the
torch internals relied on.
"""

from __future__ import annotations

from .offloader import (  # noqa: F401  (the public vocabulary of offload)
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH_DEPTH,
    WHY_OPT_IN,
    CheckpointInputOffloader,
    current,
    install,
    stats,
    target,
    use_offloader,
)
from .window import OffloadStats  # noqa: F401


def __getattr__(name: str):
    """The rest of what ``ddp_patches.offload`` held when it was one module (keep reasons, copiers, the pool)."""
    from . import offloader

    try:
        return getattr(offloader, name)
    except AttributeError:
        raise AttributeError(f"module 'ddp_patches.offload' has no attribute {name!r}") from None
