"""Mechanism 4: never silently wrong. Two checks before each optimizer step, through torch's public global step
pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``).

1. The unsynchronised-gradient guard (NOTE [Which gradients DDP never averaged]): an optimizer step about to
   apply gradients that a backward wrote into trainable parameters of a DDP-wrapped module, when no forward
   through that DDP wrapper with gradient sync enabled ran since those parameters' previous step, is announced
   before the step: one WARNING on every rank (or an ``UnsynchronizedGradientsError`` with ``on_unsynced="raise"``).
2. The replica check (NOTEs [Replica check before the step], [Replica check without a collective]): before the
   first and the second optimizer step of a DDP's parameters and then before every ``replica_check_every``-th,
   each rank compares a fingerprint of its trainable parameters with rank 0's; a rank that differs logs one ERROR
   naming the first differing parameter, itself and rank 0, and by how much (or raises ``ReplicaDivergenceError``).
   It runs only for a DDP whose communication hook keeps the replicas equal (NOTE [Replica check only where DDP
   promises equal replicas]): under post-local SGD, or any hook the library cannot vouch for, it steps aside.

Both act only for DistributedDataParallel instances built under apply() in a distributed process (NOTE
[Engines]: FSDP2 and DeepSpeed build no DDP, so nothing is tracked there; a DDP that runs DDP's Python reducer for
compiled autograd is not tracked; under torch.compile a DDP whose forward dynamo traces keeps the replica check,
and only the unsynchronised-gradient guard, which counts forwards in Python, steps aside with one line; a compiled
optimizer step, ``torch.compile(opt.step)``, has dynamo trace the step hooks too, and both checks step aside).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import logging
import os
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import engines
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

ON_UNSYNCED_CHOICES = ("warn", "raise", "off")
DEFAULT_REPLICA_CHECK_EVERY = 100  # the cost at this interval: benchmarks/guard.py, README "Guard"
REPLICA_CHECK_TIMEOUT_S = 60.0  # how long a rank waits for rank 0's fingerprint before it skips the check

TARGETS = ("torch.optim.optimizer.register_optimizer_step_pre_hook",
           "torch.optim.optimizer.register_optimizer_step_post_hook")


class UnsynchronizedGradientsError(RuntimeError):
    """An optimizer step was about to apply gradients DDP never averaged (``on_unsynced="raise"``)."""


class ReplicaDivergenceError(RuntimeError):
    """This rank's trainable parameters differ from rank 0's (``on_unsynced="raise"``)."""


@dataclass
class _Settings:
    on_unsynced: str = "off"
    replica_check_every: int = 0
    active: bool = False


_settings = _Settings()


# NOTE [Which gradients DDP never averaged]
# DDP averages gradients only in a backward through a graph that a forward *of the wrapper* built while
# ``require_backward_grad_sync`` was on (DDP's _pre_forward/_post_forward prepare the reducer only then). A loss
# computed through ``ddp.module`` (or ``accelerator.unwrap_model(model)(...)``, a fused-loss kernel that takes the
# inner model, a helper that unwraps) still runs a backward that writes ``.grad`` -- the local, un-averaged
# gradient -- and the optimizer applies it: no error, and the replicas drift apart.
#
# So, per tracked DDP: a forward pre-hook counts the forwards that will synchronise (grad mode on and
# ``require_backward_grad_sync``: DDP's own condition), and a post-accumulate-grad hook on each trainable parameter
# records that a backward wrote its gradient. At an optimizer step (the global pre-hook), each parameter of that
# optimizer written since its previous step, whose DDP counted no synchronising forward since that step, is
# unsynchronised. Counting per parameter (its count at its own last step), not per process, keeps two DDPs with two
# optimizers (GAN-style) apart, where one DDP's forward runs before the other's step.
#
# Silent by construction: ``no_sync()`` / ``accelerator.accumulate`` micro-steps (the last one runs through the
# wrapper with sync on), micro-steps through ``.module`` whose last one goes through the wrapper (DDP then
# averages the accumulated sum: correct), evaluation and generation (no backward writes a trainable gradient),
# frozen models (no trainable parameter, no hook), a single process (nothing is tracked), FSDP2/DeepSpeed (no DDP).
# Not caught here, on purpose: a synchronising forward whose output is not backpropagated, followed by a loss
# through ``.module`` (the count says "synced"); and unsynchronised micro-steps *after* the synced one. Both are
# left to the replica check, which catches divergence from any cause.
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
    hook_keeps_equal: bool | None = None  # None until a comm hook is seen (NOTE [Replica check only where ...])
    averaged_elsewhere: bool = False  # its gradients were found equal across ranks (NOTE [Confirmed before ...])


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
    # a rank of the new attempt reads the fingerprint the old attempt left under the same step (found by review: a
    # false "drifted apart" ERROR after a restart, 1 of 2 runs).
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
    """Post-accumulate-grad hook: a backward wrote this parameter's gradient (NOTE [A backward synced without a
    synced forward])."""

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
# accelerate's ``trigger_sync_in_backward`` (documented: forwards under ``no_sync()``, then the last backward inside
# it) makes DDP average a backward whose forward was not a synced one: it calls ``reducer.prepare_for_backward([])``
# itself. The forward count alone would call that unsynchronised. So when a gradient is written while the count
# says "no synced forward since this parameter's step", the reducer is asked whether this backward was one it
# averages -- at the end of the backward, from a callback queued on the autograd engine at the first such write (the
# reducer marks itself busy only when its own hook for the first parameter has run, which can be after ours; its
# finalize callback is queued after ours, so ours sees it busy). ``_check_reducer_finalized()`` raises exactly then
# (DDP's own "Expected to have finished reduction" check). A training loop through the wrapper never asks; a
# ``no_sync()`` micro-step asks once per backward and finds the reducer idle (no error, nothing recorded). When the
# reducer is busy, DDP records that error text in its logging data (``_get_ddp_logging_data()["has_error"]``): only
# the trigger pattern shows it, and nothing reads it in training.
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
        due = _replica_check_due(tracked.steps, every)
        if due and not tracked.no_store and _replicas_promised_equal(tracked):
            check_replicas(tracked)


def _replica_check_due(step: int, every: int) -> bool:
    return (step <= 2 or step % every == 0) if every else False


# NOTE [Confirmed before it speaks]
# The forward count says only that DDP did not average a backward; gradients averaged another way are correct:
# micro-steps under ``no_sync()`` (or through ``.module``) followed by ``dist.all_reduce(p.grad); p.grad /= world``
# by hand. So a step the count calls unsynchronised is reported only if the gradients really differ across ranks:
# each rank of the DDP's group writes a fingerprint of the gradients this optimizer is about to apply for that DDP
# (per parameter, float64 sum and L2 norm, in the optimizer's order) to the rendezvous store, then reads one
# partner's (rank 0 reads its group's second rank, every other rank reads rank 0), and compares bit for bit, as the
# replica check compares parameters (NOTE [Replica check without a collective]: no collective, a bounded wait; a
# partner that does not come is a skipped check, logged, never a verdict). Equal: silent, and the DDP is marked
# averaged elsewhere, after which the confirmation runs only at steps 1 and 2 and then every ``replica_check_every``-th
# (100 where that is 0), so a hand-averaged loop pays it rarely. Different: the report as before, at step 1
# for a forward through ``.module`` or a whole loop under ``no_sync()``, on every rank whose gradients differ from
# its partner's. Tests: tests/test_guard.py::test_hand_averaged_gradients_are_silent and the catches above it.
def _gradients_differ(tracked: _Tracked, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this rank's gradients for ``tracked``'s parameters differ from its partner's (NOTE [Confirmed
    before it speaks]); False where they are equal or the comparison could not be made."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if _owner.get(id(p)) is tracked and p.grad is not None]
    ranks, me = tracked.group_ranks, dist.get_rank()
    if len(ranks) < 2:
        return True
    mine = fingerprint(grads)
    key = f"{tracked.key_prefix}/grads/{tracked.steps + 1}"
    partner = ranks[1] if me == ranks[0] else ranks[0]
    try:
        store = _store()
        store.set(f"{key}/{me}", mine.numpy().tobytes())
        store.wait([f"{key}/{partner}"], datetime.timedelta(seconds=REPLICA_CHECK_TIMEOUT_S))
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


# NOTE [Replica check only where DDP promises equal replicas]
# DDP keeps its replicas equal because every rank applies the same averaged gradient: its own all-reduce, or a
# communication hook that hands every rank the same result. A hook may keep them apart on purpose: post-local SGD
# (``post_localSGD_hook``) averages gradients only within a subgroup, or not at all, after ``start_localSGD_iter``,
# and a model averager (``PeriodicModelAverager``, ``HierarchicalModelAverager``, usually behind
# ``PostLocalSGDOptimizer``) brings the replicas together only every ``period`` steps. Between those steps they differ
# by design; comparing them is a false ERROR, and with on_unsynced="raise" a crash of a run that trains fine without
# the library. So a DDP's replicas are checked only while its hook is one the library vouches for:
#   * none (DDP's all-reduce), or the C++ built-ins ALLREDUCE and FP16_COMPRESS;
#   * ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, and ``fp16_compress_wrapper`` /
#     ``bf16_compress_wrapper`` around a vouched hook: an all-reduce, then the same cast on every rank;
#   * ``powerSGD_hook``: P and Q are all-reduced and every rank computes the same P Q^T from them; the error
#     feedback is per rank but is only carried into that rank's next input, never applied (measured: bit-equal
#     replicas at every step, tests/test_guard_local_sgd.py). Not ``batched_powerSGD_hook``: the same design, but
#     in torch 2.13 it fails inside itself (``_orthogonalize`` is handed a 2-D matrix), so nothing could be measured;
#   * the hooks DDP registers itself, over its own group, for ``mixed_precision`` and for optimizers applied in
#     backward (the check ran under them before; they are DDP's all-reduce plus a cast or an in-place step);
# and, for a hook handed a process group, only when that group holds every rank of the DDP's group (the same average
# reaches all of them). Any other hook -- ``post_localSGD_hook``, the debugging ``noop_hook``, the quantization hooks,
# a user's own -- may keep the replicas apart, so the check steps aside for that DDP and says so in one WARNING on
# rank 0. The user did nothing wrong, but a protection that is on by default (or was asked for with "raise") is off
# for that model, and a real drift there would go unreported: that is worth a WARNING, as the compile step-aside is.
# The unsynchronised-gradient guard stays on: the forwards still go through the wrapper.
#
# The hook decides, not the averager: averaging equal replicas leaves them equal on every rank (one all-reduce
# result), so with a vouched hook the check stays valid under an averager (tested); and only a hook that keeps
# gradients local gives an averager something to bring together. So nothing is patched: DDP records the hook it was
# given (``ddp._comm_hooks``; a C++ built-in only by name, in its logging data), read at the first check that finds
# one (DDP takes a single hook, before its first backward). ``PostLocalSGDOptimizer`` could not be seen from here
# anyway: it never calls ``Optimizer.__init__``, so only its inner optimizer runs the step hooks. Hooks are matched by
# module and qualified name, not identity: nothing needs importing, and a torch that moves or renames one fails safe
# (not vouched: the check steps aside).
_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks."
_BUILTIN_HOOKS = ("BuiltinCommHookType.ALLREDUCE", "BuiltinCommHookType.FP16_COMPRESS")
# hook -> where it takes its process group from: its state ("state"), the state's process_group ("process_group"),
# or the DDP itself ("ddp": DDP registered it)
_VOUCHED_HOOKS = {
    _HOOKS + "default_hooks.allreduce_hook": "state",
    _HOOKS + "default_hooks.fp16_compress_hook": "state",
    _HOOKS + "default_hooks.bf16_compress_hook": "state",
    _HOOKS + "powerSGD_hook.powerSGD_hook": "process_group",
    _HOOKS + "mixed_precision_hooks._reducer_allreduce_and_upcast_hook": "ddp",
    _HOOKS + "optimizer_overlap_hooks._apply_optim_in_backward_hook.<locals>.apply_optim_in_backward_hook": "ddp",
}
_VOUCHED_WRAPPERS = (_HOOKS + "default_hooks.fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook",
                     _HOOKS + "default_hooks.bf16_compress_wrapper.<locals>.bf16_compress_wrapper_hook")


def _replicas_promised_equal(tracked: _Tracked) -> bool:
    """Whether this DDP's communication hook keeps its replicas equal; the first time it does not, one WARNING."""
    if tracked.hook_keeps_equal is not None:
        return tracked.hook_keeps_equal
    ddp = tracked.ddp()
    if ddp is None:
        return True
    hook = _registered_hook(ddp)
    if hook is None:
        return True  # DDP's own all-reduce so far; asked again at the next check
    fn, state = hook
    tracked.hook_keeps_equal = fn in _BUILTIN_HOOKS if isinstance(fn, str) else _vouched(fn, state, tracked.group_ranks)
    if not tracked.hook_keeps_equal:
        log_rank0_once(
            f"guard-hook-aside-{tracked.index}", logging.WARNING,
            "ddp_patches: the replica check steps aside for %s: its communication hook %s does not promise equal "
            "replicas (post-local SGD and model averaging keep them apart between averaging steps by design; the "
            "check vouches only for DDP's all-reduce, the fp16/bf16 compress hooks and PowerSGD), so it compares "
            "nothing for this model; the unsynchronised-gradient guard stays on (NOTE [Replica check only where DDP "
            "promises equal replicas] in ddp_patches/guard.py)", tracked.label, _hook_name(fn).removeprefix(_HOOKS))
    return tracked.hook_keeps_equal


def _registered_hook(ddp: DDP) -> tuple[Any, Any] | None:
    """(hook, state) of the Python hook DDP was given, (name, None) for a C++ built-in, None for none yet."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return hooks[-1]
    try:  # a built-in is kept by the reducer; DDP's logging data has its name
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except (RuntimeError, AttributeError):
        return None
    return (name, None) if name else None


def _vouched(fn: Any, state: Any, ranks: tuple[int, ...]) -> bool:
    fn = _unwrap_partial(fn)
    name = _hook_name(fn)
    if name in _VOUCHED_WRAPPERS:  # a cast around another hook: vouched when that one is
        inner = _closure_cell(fn, "hook")
        return inner is not None and _vouched(inner, state, ranks)
    source = _VOUCHED_HOOKS.get(name)
    if source is None:
        return False
    if source == "ddp":
        return True
    group = state if source == "state" else getattr(state, "process_group", None)
    return _covers(group, ranks)


def _covers(group: Any, ranks: tuple[int, ...]) -> bool:
    """The hook's group (None: the default group) holds every rank of the DDP's group."""
    if group is None:
        return True
    try:
        return set(ranks) <= set(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, TypeError, AttributeError):  # not a process group: cannot vouch
        return False


def _unwrap_partial(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _closure_cell(fn: Any, name: str) -> Any:
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None or name not in code.co_freevars:
        return None
    return closure[code.co_freevars.index(name)].cell_contents


def _hook_name(fn: Any) -> str:
    """'module.qualname' of a hook function, through functools.partial (a C++ built-in: its name)."""
    if isinstance(fn, str):
        return fn
    fn = _unwrap_partial(fn)
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


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


# NOTE [Replica check before the step]
# The check runs in the step *pre*-hook and compares the parameters as the previous steps left them: before the
# first step (the replicas DDP broadcast at construction: catches a checkpoint loaded on some ranks after wrapping),
# before the second (the first step's damage: a loss through `.module` shows here), then before every
# ``replica_check_every``-th. Not in the post-hook: an optimizer may step inside another one's step --
# ZeroRedundancyOptimizer steps its local optimizer over this rank's shard and broadcasts the shards only after it
# -- and between the inner step and that broadcast the replicas differ by design. Before any step, inner or outer,
# they agree. Nothing changes the parameters between a step's end and the next step's start in a correct loop.
#
# NOTE [Replica check without a collective]
# The check must never deadlock, and ranks may disagree about stepping (a rank that ran out of data, a step skipped
# on one rank only, a rank that raised). Any collective on the training group is unsafe then: a rank waiting in
# the check's all_reduce while its peer is already in DDP's next bucket all_reduce is a mismatched collective --
# under NCCL a hang or a silent mix of the two buffers, and an NCCL timeout aborts the communicator. A collective
# on a group of its own (gloo) would need that group created collectively first, and costs every rank a full mesh
# of connections. So the check speaks through the rendezvous store every process group already has:
#   * the DDP group's rank 0 writes its fingerprint under a key named by the DDP's index and its step count, and
#     goes on: it never waits, whatever the others do;
#   * every other rank waits for that one key at most REPLICA_CHECK_TIMEOUT_S (ranks in step are milliseconds
#     apart, DDP's backward all-reduce keeps them so) and compares it with its own fingerprint; a rank that differs
#     logs the ERROR (naming itself and rank 0) and, with on_unsynced="raise", raises.
# If only rank 0 reaches a check, nothing waits. If rank 0 does not reach it, the others wait out the timeout,
# log one WARNING that the check was skipped because the ranks disagree about how many optimizer steps they took,
# and train on; the training collectives are untouched either way. Cost per check: one read of the trainable
# parameters (two float64 reductions each), one store write on rank 0, one store read on each other rank.
#
# The fingerprint is, per trainable parameter, its float64 sum and L2 norm, compared bit for bit: DDP keeps
# replicas bit-identical (identical averaged gradients, identical optimizer math), and the same reduction of the
# same bits gives the same bits. Buffers are not compared: DDP re-broadcasts them from rank 0 at every forward
# (broadcast_buffers=True), and between two forwards running statistics legitimately differ per rank.
def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """(sum, L2 norm) of each tensor in float64, flattened, on the CPU."""
    with torch.no_grad():
        values = []
        for p in params:
            values.append(p.detach().sum(dtype=torch.float64))
            values.append(torch.linalg.vector_norm(p.detach(), dtype=torch.float64))
        return torch.stack(values).cpu()


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _key(tracked: _Tracked, step: int) -> str:
    return f"{tracked.key_prefix}/{step}"


def check_replicas(tracked: _Tracked, *, timeout_s: float | None = None) -> bool | None:
    """Compare this rank's fingerprint with its DDP group's rank 0; True: same, False: differs, None: skipped."""
    mine = fingerprint(tracked.params)
    key, me = _key(tracked, tracked.steps), dist.get_rank()
    try:
        store = _store()
        if me == tracked.publisher:
            store.set(key, mine.numpy().tobytes())
            _drop_old_key(store, tracked)
            return True
    except (RuntimeError, AttributeError, ValueError) as exc:  # no usable rendezvous store: never fail a step for it
        tracked.no_store = True
        log_rank0_once(f"guard-no-store-{tracked.index}", logging.WARNING,
                       "ddp_patches: replica check off for %s: the process group's rendezvous store is not usable "
                       "here (%s)", tracked.label, exc)
        return None
    timeout = REPLICA_CHECK_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistStoreError) as exc:  # timed out (DistStoreError is a RuntimeError subclass)
        logger.warning(
            "ddp_patches: rank %d: replica check of %s before its optimizer step %d skipped: rank %d did not reach "
            "this check within %.0f s (the ranks disagree about how many optimizer steps they took, or rank %d is "
            "stalled); training goes on, the next check compares again (%s)",
            me, tracked.label, tracked.steps, tracked.publisher, timeout, tracked.publisher,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    try:
        theirs = torch.frombuffer(bytearray(store.get(key)), dtype=torch.float64)
    except RuntimeError:  # the key was there a moment ago; a store that lost it is no reason to stop training
        return None
    if theirs.numel() == mine.numel() and bytes(theirs.numpy().tobytes()) == bytes(mine.numpy().tobytes()):
        return True
    _report_divergence(tracked, mine, theirs)
    return False


def _drop_old_key(store, tracked: _Tracked) -> None:
    """Rank 0 removes the key of the check before the previous one (every reader is long past it)."""
    every = _settings.replica_check_every or 1
    old = tracked.steps - 2 * every
    if old >= 1:
        try:
            store.delete_key(_key(tracked, old))
        except (RuntimeError, AttributeError):  # a store without delete_key: the key stays (bytes per check)
            pass


def _report_divergence(tracked: _Tracked, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    me = dist.get_rank()
    names = list(tracked.names.values())
    if theirs.numel() != mine.numel():
        detail = f"rank {tracked.publisher} has {theirs.numel() // 2} trainable parameters, this rank {len(names)}"
    else:
        differ = [i for i in range(len(names))
                  if _bits(mine[2 * i]) != _bits(theirs[2 * i]) or _bits(mine[2 * i + 1]) != _bits(theirs[2 * i + 1])]
        i = differ[0]
        mine_sum, their_sum = float(mine[2 * i]), float(theirs[2 * i])
        mine_norm, their_norm = float(mine[2 * i + 1]), float(theirs[2 * i + 1])
        detail = (f"first differing parameter '{names[i]}': sum {mine_sum:.9g} here vs {their_sum:.9g} on rank "
                  f"{tracked.publisher} (|diff| {abs(mine_sum - their_sum):.3g}), L2 norm {mine_norm:.9g} vs "
                  f"{their_norm:.9g} (relative diff {_relative(mine_norm, their_norm):.3g}); {len(differ)} of "
                  f"{len(names)} trainable parameters differ")
    message = (f"ddp_patches: rank {me}: replica check before optimizer step {tracked.steps} of {tracked.label}: "
               f"this rank's parameters differ from rank {tracked.publisher}'s, the DDP replicas have drifted apart: "
               f"{detail}. Something applied gradients DDP did not average, or changed parameters on some ranks "
               "only (a loss through `.module` after the last synced micro-step, a per-rank seed in a parameter "
               "update, a load on one rank). (NOTE [Replica check without a collective] in ddp_patches/guard.py)")
    if _settings.on_unsynced == "raise":
        raise ReplicaDivergenceError(message)
    logger.error("%s", message)


def _bits(value: torch.Tensor) -> bytes:
    return struct.pack("<d", float(value))


def _relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


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
