"""Where verification runs: CPU by default; ``DDP_PATCHES_DEVICE=cuda`` (``python -m ddp_patches validate --device
cuda``, or ``--backend nccl``) puts each rank on ``cuda:LOCAL_RANK``, wrapping around the visible GPUs (two gloo
ranks share one GPU; NCCL needs one GPU per rank, which ``validate.py`` checks)."""

from __future__ import annotations

import os
from typing import Any

import torch


def device() -> torch.device:
    if os.environ.get("DDP_PATCHES_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def to_device(batch: Any, dev: torch.device) -> Any:
    """Tensors (also inside dicts and lists) moved to ``dev``; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dev)
    if isinstance(batch, dict):
        return {k: to_device(v, dev) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, dev) for v in batch)
    return batch
