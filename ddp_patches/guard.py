"""Never silently wrong: two checks before each optimizer step, through torch's global step pre-hook.

The unsynchronised-gradient guard (here) announces a step about to apply gradients DDP never averaged (a loss
through ``.module``): one WARNING per rank, or ``UnsynchronizedGradientsError`` with ``on_unsynced="raise"``. The
replica check (``ddp_patches.replica_check``) compares the ranks' parameters before steps 1, 2 and every
``replica_check_every``-th. Both act only for DDPs built under apply() in a distributed process (NOTE [Engines]).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import engines, replica_check
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once
from .replica_check import DEFAULT_REPLICA_CHECK_EVERY, ReplicaDivergenceError  # noqa: F401  (its old home)

logger = logging.getLogger("ddp_patches")

ON_UNSYNCED_CHOICES = ("warn", "raise", "off")

TARGETS = ("torch.optim.optimizer.register_optimizer_step_pre_hook",
           "torch.optim.optimizer.register_optimizer_step_post_hook")


class UnsynchronizedGradientsError(RuntimeError):
    """An optimizer step was about to apply gradients DDP never averaged (``on_unsynced="raise"``)."""


@dataclass
class _Settings:
    on_unsynced: str = "off"
    replica_check_every: int = 0
    active: bool = False


_settings = _Settings()


# NOTE [Which gradients DDP never averaged]
# Invariant: DDP averages gradients only in a backward through a graph that a forward *of the wrapper* built while
# ``require_backward_grad_sync`` was on (its _pre_forward/_post_forward prepare the reducer only then). A loss through
# ``ddp.module`` (an unwrapped model, a fused-loss kernel given the inner model) still writes the local gradient to
# ``.grad``, and the optimizer applies it: no error, and the replicas drift apart.
# Rule: per tracked DDP, a forward pre-hook counts the forwards that will synchronise (grad mode on and
# ``require_backward_grad_sync``: DDP's own condition), and a post-accumulate-grad hook on each trainable parameter
# records that a backward wrote its gradient. At an optimizer step, a parameter of that optimizer written since its
# previous step, whose DDP counted no synchronising forward since then, is a suspect. Counting per parameter, not
# per process, keeps two DDPs with two optimizers (GAN-style) apart. Silent by construction: ``no_sync()``
# micro-steps whose last one runs through the wrapper, evaluation, frozen models, a single process, FSDP2/DeepSpeed.
# What the count cannot see (a synced forward left unused, then a loss through ``.module``) is the replica check's.
# Tests: tests/test_guard.py::test_loss_through_module_warns_at_the_first_step_on_every_rank and
# tests/test_guard.py::test_correct_patterns_are_silent
@dataclass(eq=False)
class _Tracked:
    index: int
    label: str  # "DistributedDataParallel(Qwen2ForCausalLM)"
    ddp: Any  # weakref.ref to the DDP
    names: dict[int, str]  # id(param) -> name, trainable parameters only, in module order
    params: list[torch.nn.Parameter]
    synced_forwards: int = 0
    steps: int = 0  # optimizer steps that touched this DDP's parameters
    stepped_aside: bool = False
    no_store: bool = False  # the replica check found no usable rendezvous store: it is off for this DDP
    warned: bool = False
    baseline: dict[int, int] = field(default_factory=dict)  # id(param) -> synced_forwards at its last step
    pending_task: int = -2  # the backward whose suspicious writes await _resolve, and their ids
    pending: list = field(default_factory=list)
    publisher: int = 0  # global rank of the DDP group's rank 0
    key_prefix: str = ""  # where its fingerprints go in the rendezvous store
    group_ranks: tuple[int, ...] = ()
    # None until a comm hook is seen: NOTE [Replica check only where DDP promises equal replicas]
    hook_keeps_equal: bool | None = None
    averaged_elsewhere: bool = False  # its gradients were found equal across ranks: NOTE [Confirmed before it speaks]


_counter = itertools.count()  # never reset: one index per tracked DDP for the life of the process
_group_counters: dict[tuple[int, ...], "itertools.count[int]"] = {}  # per group of ranks, never reset (store keys)
_owner: dict[int, _Tracked] = {}  # id(param) -> its tracked DDP
# id(param) -> (tracked DDP, averaged by a backward DDP prepared itself), for gradients written since its last step
_written: dict[int, tuple[_Tracked, bool]] = {}


def track(ddp: DDP) -> None:
    """Called once per DDP built under apply() in a distributed process (from DDP.__init__)."""
    if not _settings.active or getattr(ddp, "_use_python_reducer", False):
        return
    ignored = getattr(ddp, "parameters_to_ignore", set())
    named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    if not named:
        return  # a frozen model: nothing a step could apply
    ranks = tuple(dist.get_process_group_ranks(ddp.process_group))
    tracked = _Tracked(next(_counter), f"{type(ddp).__name__}({type(ddp.module).__name__})", weakref.ref(ddp),
                       {id(p): n for n, p in named}, [p for _, p in named], publisher=ranks[0], group_ranks=ranks)
    # The store key must be the same on the members of this DDP's group and differ from any other group's: DDPs
    # are built collectively, in the same order, by the members of their group (not by other processes).
    # The launcher's store outlives an elastic restart (torchrun --max-restarts): the attempt is part of the key, or
    # a rank of the new attempt reads the fingerprint the old attempt left under the same step.
    group = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    index = next(_group_counters.setdefault(ranks, itertools.count()))
    tracked.key_prefix = f"ddp_patches/replica/{attempt}/{group}/{index}"
    REGISTRY.add_handle(ddp.register_forward_pre_hook(_Counter(tracked)))
    if _settings.on_unsynced != "off":
        hook = _Written(tracked)
        for _, p in named:
            REGISTRY.add_handle(p.register_post_accumulate_grad_hook(hook))
    for _, p in named:
        _owner[id(p)] = tracked
    weakref.finalize(ddp, _forget, tracked)
    log_rank0_once(f"guard-watch:{tracked.label}:{len(named)}", logging.INFO,
                   "ddp_patches: the guard watches %s (%d trainable tensors): %s", tracked.label, len(named),
                   describe())


def _forget(tracked: _Tracked) -> None:
    for pid in [k for k, v in _owner.items() if v is tracked]:
        del _owner[pid]
    for pid in [k for k, v in _written.items() if v[0] is tracked]:
        del _written[pid]


class _Inert:
    """What a pickled or copied hook becomes: a copy of a DDP (``torch.save(ddp)``, ``copy.deepcopy``) is not the
    tracked instance, and the hooks hold process-local state (weak references) that cannot be pickled."""

    def __call__(self, *args: Any) -> None:
        return None


class _Counter:
    """Forward pre-hook on the DDP wrapper: count the forwards after which DDP will average gradients."""

    def __reduce__(self):
        return (_Inert, ())

    def __init__(self, tracked: _Tracked) -> None:
        self.tracked = tracked

    def __call__(self, ddp: DDP, args: Any) -> None:
        if engines.compiling():
            self._step_aside("dynamo traces this DDP's forward")
        elif torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            self.tracked.synced_forwards += 1

    def _step_aside(self, why: str) -> None:
        # Only the forward count is lost: the replica check runs in the optimizer's step pre-hook, outside the
        # traced forward, and still catches drift under compile (compiled DDP + no_sync can drift unpatched too).
        self.tracked.stepped_aside = True
        log_rank0_once(f"guard-aside-{self.tracked.index}", logging.WARNING,
                       "ddp_patches: the unsynchronised-gradient guard steps aside for %s under torch.compile: %s; "
                       "the replica check stays on (NOTE [Engines] in ddp_patches/engines.py)", self.tracked.label,
                       why)


class _Written:
    """Post-accumulate-grad hook: a backward wrote this parameter's gradient
    (NOTE [A backward synced without a synced forward])."""

    def __reduce__(self):
        return (_Inert, ())

    def __init__(self, tracked: _Tracked) -> None:
        self.tracked = tracked

    def __call__(self, param: torch.Tensor) -> None:
        pid, tracked = id(param), self.tracked
        _written[pid] = (tracked, False)
        if tracked.synced_forwards == tracked.baseline.get(pid, 0):  # suspicious: ask the reducer, once per backward
            task = torch._C._current_graph_task_id()
            if task == -1:  # not inside a backward (a direct call): no engine to ask at its end
                return
            if tracked.pending_task != task:
                tracked.pending_task, tracked.pending = task, []
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(_resolve, tracked, tracked.pending))
            tracked.pending.append(pid)


# NOTE [A backward synced without a synced forward]
# Invariant: a backward DDP averaged is never called unsynchronised, also when its forward was not a synced one:
# accelerate's ``trigger_sync_in_backward`` (forwards under ``no_sync()``, then the last backward inside it) calls
# ``reducer.prepare_for_backward([])`` itself, which the forward count cannot see.
# Rule: when a gradient is written while the count says "no synced forward since this parameter's step", ask the
# reducer whether it averages this backward, at the end of the backward, from a callback queued on the autograd
# engine at the first such write: the reducer marks itself busy only once its own hook has run (possibly after
# ours), and its finalize callback is queued after ours, so ours sees it busy. ``_check_reducer_finalized()``
# raises exactly then (DDP also records that text in its logging data, which nothing reads in training). A loop
# through the wrapper never asks; a ``no_sync()`` micro-step asks once per backward and finds the reducer idle.
# Test: tests/test_guard.py::test_accelerate_trigger_sync_in_backward_is_silent
def _resolve(tracked: _Tracked, pids: list[int]) -> None:
    ddp = tracked.ddp()
    try:  # a DDP whose group was destroyed holds teardown's ReleasedReducer, which raises on any attribute
        check = getattr(getattr(ddp, "reducer", None), "_check_reducer_finalized", None)
    except RuntimeError:
        return
    if check is None:
        return
    try:
        check()
    except RuntimeError:  # the reducer was averaging this backward
        for pid in pids:
            if pid in _written and _written[pid][0] is tracked:
                _written[pid] = (tracked, True)


# -- the optimizer step hooks ----------------------------------------------------------------------------------
# NOTE [Only the outermost step]
# An optimizer may step another inside its step (ZeroRedundancyOptimizer steps a local optimizer over this rank's
# shard). Only the outermost step is checked and counted: the inner one's parameters are a per-rank subset (a rank
# whose shard holds none of a DDP's parameters would count fewer steps than its peers, and the replica checks would
# then compare different steps), and the outer step already covered every parameter. Depth is kept by the pre- and
# post-hooks; a step that raised skips its post-hook, so a pre-hook of the very optimizer recorded as outermost
# means that depth is stale and starts over.
# Test: tests/test_guard.py::test_zero_redundancy_optimizer_is_silent
_nesting = {"depth": 0, "outer": 0}


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _nesting["depth"] and _nesting["outer"] != id(optimizer):
        _nesting["depth"] += 1  # a step inside a step: NOTE [Only the outermost step]
        return
    _nesting["depth"] = 0
    # After destroy_process_group (trainer.end()) a step is a single process's business: nothing to check
    if not _owner or engines.compiling() or not is_distributed():
        return
    _check_step(optimizer)
    _nesting["depth"], _nesting["outer"] = 1, id(optimizer)


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _nesting["depth"]:
        _nesting["depth"] -= 1


def _check_step(optimizer: torch.optim.Optimizer) -> None:
    touched: dict[int, _Tracked] = {}
    unsynced: dict[int, tuple[_Tracked, str]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            pid = id(p)
            tracked = _owner.get(pid)
            if tracked is None:
                continue
            touched[tracked.index] = tracked
            write = _written.pop(pid, None)
            if write is None:
                continue
            synced_since = tracked.synced_forwards != tracked.baseline.get(pid, 0) or write[1]
            tracked.baseline[pid] = tracked.synced_forwards
            if not synced_since and not tracked.stepped_aside and tracked.index not in unsynced:
                unsynced[tracked.index] = (tracked, tracked.names[pid])
    every = _settings.replica_check_every
    for tracked, name in unsynced.values():
        if tracked.warned:
            continue  # said once per DDP and process already (a run that does this does it every step)
        step = tracked.steps + 1
        due = not tracked.averaged_elsewhere or step <= 2 or step % (every or DEFAULT_REPLICA_CHECK_EVERY) == 0
        if due and _gradients_differ(tracked, optimizer):
            _report_unsynced(tracked, name)
    for tracked in touched.values():
        tracked.steps += 1
        due = replica_check.due(tracked.steps, every)
        if due and not tracked.no_store and replica_check.promised_equal(tracked):
            replica_check.check_replicas(tracked, every=every, on_divergence=_settings.on_unsynced)



# NOTE [Confirmed before it speaks]
# Invariant: the forward count says only that DDP did not average a backward; gradients averaged another way
# (``no_sync()`` micro-steps, then ``dist.all_reduce(p.grad); p.grad /= world`` by hand) are correct and are never
# reported.
# Rule: a step the count calls unsynchronised is reported only if the gradients really differ: each rank of the
# DDP's group writes a fingerprint of the gradients this optimizer is about to apply for that DDP (per parameter,
# float64 sum and L2 norm, in the optimizer's order) to the rendezvous store, reads one partner's (rank 0 reads its
# group's second rank, every other rank reads rank 0) and compares bit for bit, with no collective and a bounded
# wait (NOTE [Replica check without a collective]); a partner that does not come is a skipped check, never a verdict.
# Equal: silent, and the DDP is averaged elsewhere: confirmed again only at steps 1 and 2 and every
# ``replica_check_every``-th (100 where that is 0). Different: reported on every rank whose gradients differ.
# Tests: tests/test_guard.py::test_hand_averaged_gradients_are_silent and
# tests/test_guard.py::test_hand_averaging_left_out_later_is_reported
def _gradients_differ(tracked: _Tracked, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this rank's gradients for ``tracked``'s parameters differ from its partner's; False where they are
    equal or the comparison could not be made (NOTE [Confirmed before it speaks])."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if _owner.get(id(p)) is tracked and p.grad is not None]
    ranks, me = tracked.group_ranks, dist.get_rank()
    if len(ranks) < 2:
        return True
    mine = replica_check.fingerprint(grads)
    key = f"{tracked.key_prefix}/grads/{tracked.steps + 1}"
    partner = ranks[1] if me == ranks[0] else ranks[0]
    try:
        store = replica_check.rendezvous_store()
        store.set(f"{key}/{me}", mine.numpy().tobytes())
        store.wait([f"{key}/{partner}"], datetime.timedelta(seconds=replica_check.REPLICA_CHECK_TIMEOUT_S))
        theirs = bytes(store.get(f"{key}/{partner}"))
    except (RuntimeError, AttributeError, ValueError) as exc:
        logger.warning("ddp_patches: rank %d: %s: could not compare gradients with rank %d before optimizer step "
                       "%d (%s); the unsynchronised-gradient check is skipped for this step", me, tracked.label,
                       partner, tracked.steps + 1, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    if theirs == bytes(mine.numpy().tobytes()):
        tracked.averaged_elsewhere = True
        return False
    return True


def _report_unsynced(tracked: _Tracked, name: str) -> None:
    message = (
        f"ddp_patches: rank {dist.get_rank()}: this optimizer step applies gradients that DistributedDataParallel "
        f"never averaged: a backward wrote the gradient of trainable parameter '{name}' (the first such) of "
        f"{tracked.label}, but no forward through the DDP wrapper with gradient sync enabled ran since this "
        "parameter's previous optimizer step, so every rank steps with its own local gradient and the replicas "
        "drift apart. Likely cause: the loss was computed through `.module` or an unwrapped model "
        "(accelerator.unwrap_model(model)(...), a fused-loss kernel such as Liger's that calls the inner model, a "
        "helper that unwraps). Fix: run every forward whose loss you backpropagate through the DDP wrapper (at "
        "least the last micro-step before each optimizer step, outside no_sync()); unwrap only for inference and "
        "generation. (NOTE [Which gradients DDP never averaged] in ddp_patches/guard.py; "
        "apply(on_unsynced='raise') makes this an error, 'off' silences it.)"
    )
    if _settings.on_unsynced == "raise":
        raise UnsynchronizedGradientsError(message)
    if not tracked.warned:  # once per DDP and process: a run that does this does it every step
        tracked.warned = True
        logger.warning("%s", message)


# -- install / uninstall ---------------------------------------------------------------------------------------
class _Handles:
    """The global optimizer step hooks as one removable handle for the registry (it also forgets the state)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        _settings.active = False
        _owner.clear()
        _written.clear()
        _nesting["depth"] = 0


def _tracking_init(original_init):
    """DDP.__init__ that tracks the instance; used only when apply(reducer=False) (the reducer's own __init__
    calls ``track`` otherwise)."""

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if is_distributed():
            track(self)

    return __init__


def install(*, on_unsynced: str, replica_check_every: int) -> list[str]:
    """Register the global optimizer step hooks; track every DDP built from now on. Nothing when both are off."""
    if on_unsynced == "off" and not replica_check_every:
        return []
    _settings.on_unsynced = on_unsynced
    _settings.replica_check_every = replica_check_every
    _settings.active = True
    REGISTRY.add_handle(_Handles())
    installed = list(TARGETS)
    if not REGISTRY.is_patched(DDP, "__init__"):
        REGISTRY.install(DDP, "__init__", _tracking_init)
        installed.append("DistributedDataParallel.__init__")
    return installed


def describe() -> str:
    """One line for apply()'s report and the doctor."""
    if not _settings.active:
        return "guard: off"
    replica = (f"replica check before steps 1 and 2 and every {_settings.replica_check_every}th"
               if _settings.replica_check_every else "replica check off")
    return f"guard: unsynchronised gradients -> {_settings.on_unsynced}; {replica}"
