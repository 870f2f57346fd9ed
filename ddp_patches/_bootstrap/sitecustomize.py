"""Start-up hook of ``ddp-patches-run`` (ddp_patches/autoapply.py): apply() once torch is imported.

This directory is put first on PYTHONPATH only by ``ddp-patches-run``; the sitecustomize it shadows (the user's,
or the system's, further on the path) is imported right after, in every interpreter
(NOTE [A start-up hook in every interpreter]).
"""

# NOTE [A start-up hook in every interpreter]
# Invariant: PYTHONPATH reaches every Python process the command starts, including interpreters without
# ddp_patches (a helper run with the system's ``python3``, a tool's own venv); there this hook is silent and inert,
# and the sitecustomize it shadows (Debian ships one, apport's hook) still runs.
# Rule: this file imports only the standard library itself; where ddp_patches cannot be found it does nothing and
# says nothing (torch, if that interpreter has one, runs unpatched, as without the runner); in every case it
# chains the next sitecustomize on the path with its own code, since the library may be missing. Any other error
# -- in ddp_patches, or in the sitecustomize it chains -- is shown, as Python shows it.
# Test: tests/test_bootstrap_children.py::test_a_child_of_another_interpreter_is_silent_and_runs_the_shadowed_sitecustomize.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3

import os
import sys


def _autoapply():
    """``ddp_patches.autoapply``, or None where this interpreter cannot import ddp_patches."""
    try:
        from ddp_patches import autoapply
    except ImportError as e:
        if e.name in ("ddp_patches", "ddp_patches.autoapply"):
            return None  # another interpreter, without the library: inert and silent
        raise
    return autoapply


def _chain_next_sitecustomize() -> None:
    """Import the next ``sitecustomize`` on sys.path after this one (the user's or the system's), if any."""
    here = os.path.dirname(os.path.realpath(__file__))
    positions = [i for i, p in enumerate(sys.path) if os.path.realpath(p or ".") == here]
    if not positions:
        return
    this = sys.modules[__name__]
    saved = [sys.path.pop(i) for i in reversed(positions)]
    del sys.modules["sitecustomize"]
    try:
        import sitecustomize  # noqa: F401 - the next one on the path, if any
    except ImportError as e:
        if e.name != "sitecustomize":
            raise  # the shadowed sitecustomize itself failed: show it, as Python would
        sys.modules["sitecustomize"] = this
    finally:
        for i, p in zip(sorted(positions), reversed(saved)):
            sys.path.insert(i, p)


try:
    # Switched off (a leftover PYTHONPATH entry): nothing is imported. The same test as autoapply.bootstrap().
    _library = _autoapply() if os.environ.get("DDP_PATCHES_APPLY") == "1" else None
    if _library is not None:
        _library.bootstrap()
finally:
    _chain_next_sitecustomize()
