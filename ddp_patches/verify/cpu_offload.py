"""The offloader tests and validation use to run offload's real pack/unpack path on CPU."""

from __future__ import annotations

from ddp_patches.offload import CheckpointInputOffloader


def cpu_path_offloader(*, single_process: bool = False, **kwargs) -> CheckpointInputOffloader:
    """Moves every eligible checkpoint input, CPU tensors included, into separate host buffers (no size
    threshold unless ``min_bytes`` is given). Gated on DDP like the default, or always on with
    ``single_process``."""
    kwargs.setdefault("min_bytes", 0)
    if single_process:
        kwargs["gate"] = lambda: True
    return CheckpointInputOffloader(should_offload=lambda t: True, **kwargs)
