"""What each patch assumes about torch's private internals, checked when the patch is installed.

# NOTE [Probed assumptions]
# Every patch here leans on something torch does not promise: a module global that ``checkpoint()`` looks up at
# call time, the saved-tensor hook stack, an attribute DDP sets on itself, the order in which autograd runs
# final callbacks. A torch release may move any of them without notice; torch 2.14 did (``checkpoint()`` now
# calls ``_checkpoint_without_reentrant_generator_impl``, so a wrapper of the old generator was never reached and
# offload silently moved nothing). So each patch lists its assumptions (``Assumption``: a name, what it says, and
# a check that is a signature or attribute test or a behaviour probe on a tiny CPU tensor, milliseconds), and
# apply() runs them before installing that patch. Where one fails, that patch -- only that one -- is not
# installed, and one WARNING line names the torch version, the patch and the assumption: a newer torch degrades
# to "no offload" or "no swap", which is what an unpatched run does, never to a crash inside the library or a
# wrong gradient. The other patches install as usual. The results are kept per process (a probe runs once; a
# re-apply reuses the answer) and forgotten by revert(), so a test that breaks an internal on purpose and then
# restores it sees the probe run again.
# Cost at apply(): a few milliseconds for the default patches (the probes call the checkpoint function unwrapped
# and backpropagate without an explicit gradient, which would import dynamo or sympy). Offload's probe runs a
# non-reentrant checkpoint, which imports dynamo (about 2 s, once per process); only apply(offload=True) pays it.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

TESTED_TORCH = "2.4 to 2.15"  # the lanes (README "Versions")


class AssumptionFailed(Exception):
    """Raised by a check: the assumption does not hold on this torch (the message says what was found)."""


@dataclass(frozen=True)
class Assumption:
    name: str  # short, stable: used in the WARNING line and by tests
    says: str  # what the patch relies on, in words
    check: Callable[[], None]  # returns when it holds, raises when it does not


# patch -> (name of the first failing assumption, what was found) or None when all hold
_results: dict[str, tuple[str, str] | None] = {}


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
        "(%s). %s; the other patches are unaffected. Tested with torch %s; please report this line in an issue "
        "(README, 'A newer torch')", torch.__version__, patch, says, name, found, consequence, TESTED_TORCH)
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
    """Drop the cached results (revert() calls it)."""
    _results.clear()


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
# The runner (ddp-patches-run) applies at the end of torch's own import, while this thread still holds torch's
# module lock; a user's module may call apply() in its body, an import hook from its find_spec (under the global
# import lock). A probe thread that touches a module still being imported (``import torch`` in a probe, while
# torch is initialising) or any import under that global lock waits for it, and the caller waits for the thread:
# every process the runner started hung before its first line of output. So while the calling thread is itself
# inside the import machinery, the checks run on it. Only this thread's stack counts: another thread's import
# cannot block the probe thread for good, and must not take the caller's context into the checks; sys.modules is
# not scanned (reading a lazily loaded module's __spec__ runs its body). At the end of torch's import no user
# state can exist yet (grad mode, modes and saved-tensor hooks all need torch); inside a user's import the checks
# see that import's context, less grad mode, inference mode, the default device and autocast.
def _inside_an_import() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


# NOTE [Probes test torch, not the caller's context]
# apply() may run anywhere: under torch.inference_mode() or no_grad, inside ``with torch.device("meta")`` (a model
# built on the meta device), inside the user's own saved_tensors_hooks / save_on_cpu() /
# disable_saved_tensors_hooks, under a FakeTensorMode or another dispatch or function mode, under autocast or
# vmap -- and the runner's deferred apply() runs inside init_process_group, wherever that is called. Run there, a
# behaviour probe failed (inference tensors cannot be saved for backward; meta tensors have no values; the hook
# stack was disabled) and its cached result turned a patch off for the whole process, with a WARNING blaming
# torch; the user's pack hooks and modes also saw the probe's tensors. Every one of those states is per thread in
# torch, so the checks run on a fresh thread, which starts with none of them: grad on, no inference mode, CPU
# device, no autocast, no modes, no saved-tensor hooks. Nothing process-wide is changed (the default dtype is
# not touched: the probes give their tensors a dtype).
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
