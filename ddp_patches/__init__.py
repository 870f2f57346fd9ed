"""ddp_patches: DDP-safe activation checkpointing and reducer set-up for LoRA/QLoRA fine-tuning.

    import ddp_patches
    ddp_patches.apply()      # before building TrainingArguments / Trainer / SFTTrainer / DDP

Importing this package changes nothing; apply() installs the patches and revert() removes them.
"""

from .api import ApplyReport, apply, is_applied, patched, revert
from .distributed import is_distributed
from .doctor import Diagnosis, Finding, diagnose
from .offload import OffloadStats
from .offload import stats as offload_stats
from .reducer import TrainableParametersChangedError
from .versions import UnsupportedVersionError

__version__ = "0.1.0"

__all__ = [
    "ApplyReport",
    "Diagnosis",
    "Finding",
    "OffloadStats",
    "TrainableParametersChangedError",
    "UnsupportedVersionError",
    "apply",
    "diagnose",
    "is_applied",
    "is_distributed",
    "offload_stats",
    "patched",
    "revert",
    "__version__",
]
