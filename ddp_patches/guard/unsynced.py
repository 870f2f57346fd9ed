"""The unsynchronised-gradient guard's tracking: per DDP built under apply() (``track``, from
ddp_patches/rescue/built.py), a forward counter and a post-accumulate-grad hook per trainable parameter, which the
optimizer step check (``ddp_patches.guard.steps``) reads to find gradients DDP never averaged.
"""

from __future__ import annotations

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

from .. import engines
from .._registry import REGISTRY
from ..distributed import log_rank0_once

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
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §8
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
    drifted: set = field(default_factory=set)  # partners found apart and reported: NOTE [One ERROR per drift]
    warned: bool = False
    baseline: dict[int, int] = field(default_factory=dict)  # id(param) -> synced_forwards at its last step
    # id(param) -> averaged by a backward DDP prepared itself, for gradients written since the parameter's last step
    written: dict[int, bool] = field(default_factory=dict)
    pending_task: int = -2  # the backward whose suspicious writes await _resolve, and their ids
    pending: list = field(default_factory=list)
    publisher: int = 0  # global rank of the DDP group's rank 0
    key_prefix: str = ""  # where its fingerprints go in the rendezvous store
    group_ranks: tuple[int, ...] = ()
    # None until a comm hook is seen: NOTE [Replica check only where DDP promises equal replicas]
    hook_keeps_equal: bool | None = None
    # The store protocol of both checks (NOTE [A store wait has a partner that will come] in replica_check.py)
    segment: int = 0  # Joins this DDP took part in, over: NOTE [Join ends a segment of step counts]
    segment_base: int = 0  # ``steps`` when the segment began
    forwards_at_step: int = 0  # ``synced_forwards`` at this DDP's previous step
    synced_in_segment: bool = False  # a step of this segment followed a synchronised forward
    anchored: bool = False  # this step followed a synchronised forward
    may_wait: bool = False  # this rank may wait in the store at this step
    iteration_optimizers: set = field(default_factory=set)  # ids of the optimizers that stepped since the last sync
    unpaired: bool = False  # a wait timed out in this segment: none more in it
    left: set = field(default_factory=set)  # partners out of data in this segment
    records: list = field(default_factory=list)  # (step, key) this rank wrote to the store and has not deleted
    fingerprints: list = field(default_factory=list)  # this rank's replica-check keys in the store, oldest first


_counter = itertools.count()  # never reset: one index per tracked DDP for the life of the process
_group_counters: dict[tuple[int, ...], "itertools.count[int]"] = {}  # per group of ranks, never reset (store keys)
_owner: dict[int, _Tracked] = {}  # id(param) -> its tracked DDP
_by_ddp: dict[int, _Tracked] = {}  # id(ddp) -> its record (a Join names its DDPs)
_owners_changed = [0]  # bumped whenever _owner changes: an optimizer's cached view of it is then stale


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
    _owners_changed[0] += 1
    _by_ddp[id(ddp)] = tracked
    weakref.finalize(ddp, _forget, tracked)
    log_rank0_once(f"guard-watch:{tracked.label}:{len(named)}", logging.INFO,
                   "ddp_patches: the guard watches %s (%d trainable tensors): %s", tracked.label, len(named),
                   describe())


def _forget(tracked: _Tracked) -> None:
    for pid in [k for k, v in _owner.items() if v is tracked]:
        del _owner[pid]
    _owners_changed[0] += 1
    for key in [k for k, v in _by_ddp.items() if v is tracked]:
        del _by_ddp[key]
    tracked.written.clear()


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
                       "the replica check stays on (NOTE [Engines] in ddp_patches/engines/__init__.py)",
                       self.tracked.label, why)


class _Written:
    """Post-accumulate-grad hook: a backward wrote this parameter's gradient
    (NOTE [A backward synced without a synced forward])."""

    def __reduce__(self):
        return (_Inert, ())

    def __init__(self, tracked: _Tracked) -> None:
        self.tracked = tracked

    def __call__(self, param: torch.Tensor) -> None:
        pid, tracked = id(param), self.tracked
        tracked.written[pid] = False
        # Every baseline is at most ``forwards_at_step``: a synchronised forward since this DDP's last step clears all
        if tracked.synced_forwards == tracked.forwards_at_step \
                and tracked.synced_forwards == tracked.baseline.get(pid, 0):  # suspicious: ask the reducer, once
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
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §8
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
            if pid in tracked.written:
                tracked.written[pid] = True


def describe() -> str:
    """One line for apply()'s report and the doctor."""
    if not _settings.active:
        return "guard: off"
    replica = (f"replica check before steps 1 and 2 and every {_settings.replica_check_every}th"
               if _settings.replica_check_every else "replica check off")
    return f"guard: unsynchronised gradients -> {_settings.on_unsynced}; {replica}"
