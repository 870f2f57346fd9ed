"""``python -m ddp_patches plan --config PATH``: the longest sequence each setup trains on one GPU, simulated.

``memsim`` runs one training step at real shapes on fake tensors (``model`` builds the model, ``live_bytes`` counts
what is alive); ``search`` finds each setup's longest sequence; ``planner`` makes the rows for a GPU and host and
prints them (the command's text, the generated docs blocks).
"""

from .planner import (DEFAULT_GPUS_PER_NODE, baseline_row, default_jobs, long_context_block, main, pinned_limits, plan,
                      plans, readme_block, render)
from .search import (PATCHED, RESERVE_BYTES, RESERVE_FRACTION, SETUPS, Setup, check_arguments, limit_of, longest,
                     longest_fast, parse_bytes, setups, usable)

__all__ = ["DEFAULT_GPUS_PER_NODE", "PATCHED", "RESERVE_BYTES", "RESERVE_FRACTION", "SETUPS", "Setup", "baseline_row",
           "check_arguments", "default_jobs", "limit_of", "long_context_block", "longest", "longest_fast", "main",
           "parse_bytes", "pinned_limits", "plan", "plans", "readme_block", "render", "setups", "usable"]
