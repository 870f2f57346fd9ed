"""What each patch assumes about torch's private internals, checked when the patch is installed.

A patch lists its ``Assumption``s and calls ``verify()`` before installing itself; ``failed()`` and ``note()``
say which patch stepped aside and why; ``has``, ``source_mentions`` and ``expect`` are the small checks the lists
share (NOTE [Probed assumptions]).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ._registry import REGISTRY
from .distributed import log_rank0_once
from .versions import TESTED

logger = logging.getLogger("ddp_patches")

TESTED_TORCH = TESTED["torch"]


class AssumptionFailed(Exception):
    """Raised by a check: the assumption does not hold on this torch (the message says what was found)."""


@dataclass(frozen=True)
class Assumption:
    name: str  # short, stable: used in the WARNING line and by tests
    says: str  # what the patch relies on, in words
    check: Callable[[], None]  # returns when it holds, raises when it does not


# patch -> (name of the first failing assumption, what was found) or None when all hold
_results: dict[str, tuple[str, str] | None] = {}


# NOTE [Probed assumptions]
# Invariant: a torch release that moves an internal a patch leans on (a module global ``checkpoint()`` looks up at
# call time, the saved-tensor hook stack, an attribute DDP sets on itself, the order of autograd's final callbacks)
# degrades that patch to "not installed" -- what an unpatched run does -- never to a crash inside the library or a
# wrong gradient; the other patches install as usual.
# Rule: each patch lists its assumptions (``Assumption``: a name, what it says, and a check: a signature or
# attribute test or a behaviour probe on a tiny CPU tensor), and apply() runs them before installing that patch.
# Where one fails, that patch alone is not installed and one WARNING names the torch version, the patch and the
# assumption. Results are kept per process (a probe runs once; a re-apply reuses the answer) and forgotten by
# revert(), so a test that breaks an internal on purpose and then restores it sees the probe run again. The
# default patches' probes call the checkpoint function unwrapped and backpropagate without an explicit gradient,
# so they import neither dynamo nor sympy; only offload's probe (a non-reentrant checkpoint) imports dynamo.
# Test: tests/test_probes.py::test_a_renamed_internal_makes_one_patch_step_aside
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §18
def verify(patch: str, assumptions: tuple[Assumption, ...], consequence: str) -> bool:
    """Run ``assumptions`` (once per process) for ``patch``; True when all hold. Otherwise log the one WARNING
    (NOTE [Probed assumptions]): ``consequence`` says what the run does without the patch."""
    if patch not in _results:
        _results[patch] = _first_failure(assumptions)
    failure = _results[patch]
    if failure is None:
        return True
    name, found = failure
    says = next(a.says for a in assumptions if a.name == name)
    log_rank0_once(
        "probe-" + patch, logging.WARNING,
        "ddp_patches: torch %s: the %s patch steps aside: it assumes %s [%s], which does not hold on this torch "
        "(%s). %s; the other patches are unaffected. Tested with torch %s; please report this line "
        "(docs/troubleshooting.md, 'Reporting a problem')", torch.__version__, patch, says, name, found, consequence, TESTED_TORCH)
    return False


def failed(patch: str) -> str | None:
    """The name of the assumption that made ``patch`` step aside in this process, or None."""
    failure = _results.get(patch)
    return None if failure is None else failure[0]


def note(patch: str) -> str | None:
    """A short line for apply()'s report when ``patch`` stepped aside."""
    failure = _results.get(patch)
    if failure is None:
        return None
    return f"{patch} stepped aside: assumption {failure[0]!r} fails on torch {torch.__version__}"


def forget() -> None:
    """Drop the cached results: a later apply() probes again (NOTE [Each module forgets its own state])."""
    _results.clear()


REGISTRY.on_reset(forget)


def _first_failure(assumptions: tuple[Assumption, ...]) -> tuple[str, str] | None:
    """Run the checks on a thread of their own (NOTE [Probes test torch, not the caller's context]), or here while
    an import is executing (NOTE [No probe thread inside an import])."""
    if _inside_an_import():
        with torch.inference_mode(False), torch.enable_grad(), torch.device("cpu"), \
                torch.autocast("cpu", enabled=False):
            return _run_checks(assumptions)
    outcome: list[tuple[str, str] | None] = []
    worker = threading.Thread(target=lambda: outcome.append(_run_checks(assumptions)), name="ddp_patches-probes")
    worker.start()
    worker.join()
    return outcome[0] if outcome else ("probe-thread", "the probe thread ended without a result")


# NOTE [No probe thread inside an import]
# Invariant: apply() never hangs inside an import. The runner (ddp-patches-run) applies at the end of torch's own
# import, while this thread still holds torch's module lock; a user's module may call apply() in its body, an
# import hook from its find_spec (under the global import lock). A probe thread that touches a module still being
# imported, or imports under that lock, would wait for it while the caller waits for the thread.
# Rule: while the calling thread is itself inside the import machinery (its own stack only: another thread's
# import cannot block the probe thread for good; sys.modules is not scanned, as reading a lazily loaded module's
# __spec__ runs its body), the checks run on it, with grad mode, inference mode, the default device and autocast
# reset around them. At the end of torch's import no user state can exist yet.
# Test: tests/test_probes.py::test_apply_inside_an_import_does_not_hang
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §18
def _inside_an_import() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


# NOTE [Probes test torch, not the caller's context]
# Invariant: a probe's verdict depends on torch alone, never on where apply() runs: under inference_mode() or
# no_grad, inside ``with torch.device("meta")``, the user's saved_tensors_hooks / save_on_cpu() /
# disable_saved_tensors_hooks, a FakeTensorMode or another mode, autocast or vmap, or inside init_process_group
# (the runner's deferred apply()). Run there, a behaviour probe fails and its cached result turns a patch off for
# the whole process, with a WARNING blaming torch; the user's pack hooks and modes would also see its tensors.
# Rule: every one of those states is per thread in torch, so the checks run on a fresh thread, which starts with
# none of them (NOTE [No probe thread inside an import] gives the one exception). Nothing process-wide is changed:
# the default dtype is not touched, the probes give their tensors a dtype.
# Test: tests/test_probes.py::test_the_callers_context_does_not_fail_a_probe
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §18
def _run_checks(assumptions: tuple[Assumption, ...]) -> tuple[str, str] | None:
    for assumption in assumptions:
        try:
            assumption.check()
        except Exception as e:  # noqa: BLE001 -- any failure of a probe means the assumption does not hold
            logger.debug("ddp_patches: probe %s failed", assumption.name, exc_info=True)
            return assumption.name, f"{type(e).__name__}: {e}"[:300]
    return None


# -- small checks shared by the patches' assumption lists -------------------------------------------------------
def has(owner, *names: str) -> None:
    """Each of ``names`` is an attribute of ``owner``."""
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise AssumptionFailed(f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}")


def source_mentions(obj, *names: str) -> None:
    """The source file of ``obj`` mentions each of ``names`` (an instance attribute that only the source shows).
    The whole file, read as text: inspect.getsource(cls) parses the file to find the class (0.1 s)."""
    import inspect

    try:
        with open(inspect.getsourcefile(obj), encoding="utf-8") as f:
            text = f.read()
    except (OSError, TypeError) as e:
        raise AssumptionFailed(f"no source for {getattr(obj, '__qualname__', obj)}: {e}") from e
    missing = [n for n in names if n not in text]
    if missing:
        raise AssumptionFailed(f"{getattr(obj, '__qualname__', obj)} no longer sets {', '.join(missing)}")


def expect(condition: bool, found: str) -> None:
    if not condition:
        raise AssumptionFailed(found)
