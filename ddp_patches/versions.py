"""Supported library versions, checked by apply() before anything is patched."""

from __future__ import annotations

import importlib.metadata
import re

# The minimums: torch 2.4 has non-reentrant checkpoint with determinism_check/early_stop and DDP's
# _static_graph_delay_allreduce_enqueued, both relied on; transformers 4.46 has the checkpointing kwargs. What each
# patch assumes about torch's internals is probed when it is installed (ddp_patches/probes.py). The one source of
# the tested range (the lanes, tools/lanes.py); pyproject.toml's bounds must agree
# (tests/test_layout.py::test_one_source_for_the_tested_range).
TESTED_RANGE = {"torch": ((2, 4), (2, 15)), "transformers": ((4, 46), (5, 24)), "peft": ((0, 13), (0, 21)),
                "trl": ((0, 12), (1, 16)), "accelerate": ((1, 0), (1, 15))}
TESTED = {name: f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}" for name, (lo, hi) in TESTED_RANGE.items()}
MINIMUM = {name: TESTED_RANGE[name][0] for name in ("torch", "transformers")}
# Offload reads the saved-tensor hook stack (torch._C._autograd._top_saved_tensors_default_hooks), which torch 2.8
# added; on 2.4-2.7 apply() installs it inert and says so in its report.
OFFLOAD_MINIMUM_TORCH = (2, 8)
# Before torch 2.8 (pytorch#154976) a ProcessGroup's Python handle runs its destructor with the GIL held; the
# teardown patch then pauses before a group is freed (NOTE [Freeing a group needs a GIL-free destructor]).
GIL_FREE_GROUP_DESTRUCTOR_TORCH = (2, 8)


class UnsupportedVersionError(RuntimeError):
    """A library that ddp_patches patches or relies on is older than the supported minimum."""


def parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVersionError(f"ddp_patches: cannot read a version number from {version!r}")
    return int(match.group(1)), int(match.group(2))


def installed(package: str) -> str | None:
    if package == "torch":  # a torch import that is already done is the one in use
        import torch

        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(versions: dict[str, str | None] | None = None) -> None:
    """Raise UnsupportedVersionError naming every package below its minimum."""
    versions = versions if versions is not None else {name: installed(name) for name in MINIMUM}
    problems = []
    for name, minimum in MINIMUM.items():
        found = versions.get(name)
        if found is not None and parse(found) < minimum:
            problems.append(
                f"{name} {found} is older than the supported minimum {minimum[0]}.{minimum[1]} "
                f"(tested with {TESTED[name]}): upgrade it, e.g. pip install -U '{name}>={minimum[0]}.{minimum[1]}'"
            )
    if problems:
        raise UnsupportedVersionError("ddp_patches: unsupported library versions:\n  " + "\n  ".join(problems))


def offload_unsupported_reason(torch_version: str | None = None) -> str | None:
    """Why offload cannot act on this torch, or None."""
    found = torch_version or installed("torch")
    if found is not None and parse(found) < OFFLOAD_MINIMUM_TORCH:
        return (f"offload needs torch >= {OFFLOAD_MINIMUM_TORCH[0]}.{OFFLOAD_MINIMUM_TORCH[1]} (found {found}): "
                "it stays inert; the other patches are unaffected")
    return None


def group_destructor_holds_gil(torch_version: str | None = None) -> bool:
    """True on a torch whose ProcessGroup destructor runs with the GIL held (before 2.8)."""
    found = torch_version or installed("torch")
    return found is not None and parse(found) < GIL_FREE_GROUP_DESTRUCTOR_TORCH


def teardown_pause_reason(torch_version: str | None = None) -> str | None:
    """apply()'s report line when destroy_process_group pauses first on this torch, or None."""
    found = torch_version or installed("torch")
    if not group_destructor_holds_gil(found):
        return None
    minimum = GIL_FREE_GROUP_DESTRUCTOR_TORCH
    return (f"teardown pauses before destroy_process_group frees a group: torch {found} (< {minimum[0]}.{minimum[1]}) "
            "runs the group's destructor with the GIL held, which deadlocks with a gloo worker still freeing a "
            "finished collective")
