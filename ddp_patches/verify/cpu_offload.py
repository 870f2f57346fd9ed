"""The offloader tests and validation use to run offload's real pack/unpack path on CPU."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ddp_patches.offload import CheckpointInputOffloader


def cpu_path_offloader(*, single_process: bool = False, **kwargs) -> CheckpointInputOffloader:
    """Moves every eligible checkpoint input, CPU tensors included, into separate host buffers (no size
    threshold unless ``min_bytes`` is given). Gated like the default (distributed, under DDP or FSDP2), or always
    on, under any engine, with ``single_process``."""
    kwargs.setdefault("min_bytes", 0)
    if single_process:
        kwargs["gate"] = lambda: True
        kwargs["engines"] = None
    return CheckpointInputOffloader(should_offload=lambda t: True, **kwargs)


def forced(**kwargs) -> CheckpointInputOffloader:
    """The CPU-path offloader, on in a single process too."""
    return cpu_path_offloader(single_process=True, **kwargs)


@contextlib.contextmanager
def offloading(offloader: CheckpointInputOffloader) -> Iterator[CheckpointInputOffloader]:
    """apply(offload=True) installs the generator patch; ``offloader`` replaces the default one inside the block."""
    import ddp_patches
    from ddp_patches.offload import offloader as offload

    with ddp_patches.patched(offload=True), offload.use_offloader(offloader):
        yield offloader
