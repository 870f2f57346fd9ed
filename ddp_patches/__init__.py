"""ddp_patches: DDP-safe activation checkpointing and reducer set-up for LoRA/QLoRA fine-tuning.

    import ddp_patches
    ddp_patches.apply()      # before building TrainingArguments / Trainer / SFTTrainer / DDP

or, without editing the script: ``ddp-patches-run torchrun --nproc_per_node=2 train.py`` (ddp_patches.autoapply).

Importing this package changes nothing and imports nothing heavy: the names below are loaded on first use
(PEP 562), so the start-up hook that ``ddp-patches-run`` puts in every Python process costs no torch import in a
process that never uses torch. apply() installs the patches and revert() removes them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (submodule, attribute)
_EXPORTS = {
    "ApplyReport": ("api", "ApplyReport"),
    "apply": ("api", "apply"),
    "is_applied": ("api", "is_applied"),
    "patched": ("api", "patched"),
    "revert": ("api", "revert"),
    "is_distributed": ("distributed", "is_distributed"),
    "Diagnosis": ("doctor", "Diagnosis"),
    "Finding": ("doctor", "Finding"),
    "diagnose": ("doctor", "diagnose"),
    "OffloadStats": ("offload", "OffloadStats"),
    "offload_stats": ("offload", "stats"),
    "TrainableParametersChangedError": ("rescue.trainable_set", "TrainableParametersChangedError"),
    "UnsynchronizedGradientsError": ("guard.unsynced", "UnsynchronizedGradientsError"),
    "ReplicaDivergenceError": ("guard.replica_check", "ReplicaDivergenceError"),
    "UnsupportedVersionError": ("versions", "UnsupportedVersionError"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddp_patches' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
