"""The replica check: before an optimizer step, each rank compares a fingerprint of its trainable parameters with
its DDP group's rank 0 through the rendezvous store, and reports a drift by the first parameter that differs.

Called by the guard (``ddp_patches.guard``), which tracks each DDP and counts its optimizer steps; ``tracked`` below
is the guard's record of one DDP. The check runs only where the DDP's communication hook keeps replicas equal.
"""

from __future__ import annotations

import datetime
import functools
import logging
import struct
from typing import Any

import torch
import torch.distributed as dist

from .distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

DEFAULT_REPLICA_CHECK_EVERY = 100  # the cost at this interval: benchmarks/guard.py
REPLICA_CHECK_TIMEOUT_S = 60.0  # how long a rank waits for rank 0's fingerprint before it skips the check


class ReplicaDivergenceError(RuntimeError):
    """This rank's trainable parameters differ from rank 0's (``on_unsynced="raise"``)."""


# NOTE [Replica check before the step]
# Invariant: the check compares parameters only where every correct loop has them equal: before a step, inner or
# outer. Between an inner step and its broadcast (ZeroRedundancyOptimizer steps its local optimizer over this rank's
# shard, then broadcasts) the replicas differ by design, so the check is never in the step post-hook.
# Rule: run in the step *pre*-hook (guard.py) before the first step (the replicas DDP broadcast at construction:
# catches a checkpoint loaded on some ranks after wrapping), before the second (the first step's damage: a loss
# through ``.module``), then before every ``replica_check_every``-th.
# Tests: tests/test_guard.py::test_replica_check_names_a_perturbed_parameter_within_n_steps and
# tests/test_guard.py::test_zero_redundancy_optimizer_is_silent
def due(step: int, every: int) -> bool:
    return (step <= 2 or step % every == 0) if every else False


# NOTE [Replica check only where DDP promises equal replicas]
# Invariant: replicas are compared only while DDP keeps them equal, i.e. while every rank applies the same averaged
# gradient. A communication hook may keep them apart by design (post-local SGD averages within a subgroup, or not
# at all, and a model averager brings them together only every ``period`` steps): a check there false-alarms, and
# with on_unsynced="raise" crashes a run that trains fine without the library.
# Rule: check only under a hook vouched for (``_BUILTIN_HOOKS``, ``_VOUCHED_HOOKS``, the compress wrappers around a
# vouched hook: all give every rank the same result; PowerSGD's error feedback is per rank but only carried into
# that rank's next input), whose group holds every rank of the DDP's group. Any other hook: the check steps aside
# for that DDP with one WARNING on rank 0; the unsynchronised-gradient guard stays on. The hook decides, not the
# averager (averaging equal replicas keeps them equal), so nothing is patched: DDP's record of its single hook
# (``ddp._comm_hooks``, or a built-in's name in its logging data) is matched by module and qualified name, so a
# torch that moves or renames a hook fails safe (not vouched).
# Tests: tests/test_replica_check.py::test_local_sgd_trains_as_without_the_library_and_the_check_steps_aside and
# tests/test_replica_check.py::test_hooks_that_keep_replicas_equal_keep_the_check_and_it_stays_silent
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


def promised_equal(tracked: Any) -> bool:
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
            "nothing for this model; the unsynchronised-gradient guard stays on "
            "(NOTE [Replica check only where DDP promises equal replicas] in ddp_patches/replica_check.py)",
            tracked.label, _hook_name(fn).removeprefix(_HOOKS))
    return tracked.hook_keeps_equal


def _registered_hook(ddp: Any) -> tuple[Any, Any] | None:
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


# The fingerprint is compared bit for bit: DDP keeps replicas bit-identical (identical averaged gradients, identical
# optimizer math), and the same reduction of the same bits gives the same bits. Buffers are not compared: DDP
# re-broadcasts them from rank 0 at every forward, and between two forwards running statistics differ per rank.
def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """(sum, L2 norm) of each tensor in float64, flattened, on the CPU."""
    with torch.no_grad():
        values = []
        for p in params:
            values.append(p.detach().sum(dtype=torch.float64))
            values.append(torch.linalg.vector_norm(p.detach(), dtype=torch.float64))
        return torch.stack(values).cpu()


def rendezvous_store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _key(tracked: Any, step: int) -> str:
    return f"{tracked.key_prefix}/{step}"


# NOTE [Replica check without a collective]
# Invariant: the check never deadlocks and never touches the training collectives, also when ranks disagree about
# stepping (a rank out of data, a step skipped on one rank, a rank that raised): a collective on the training group
# would then be a mismatched one (under NCCL a hang, or a silent mix of two buffers), and one on a group of its own
# would need that group created collectively first.
# Rule: speak through the rendezvous store every process group already has. The DDP group's rank 0 writes its
# fingerprint under a key named by the DDP's index and its step count, and never waits; every other rank waits for
# that one key at most REPLICA_CHECK_TIMEOUT_S, compares, and a rank that differs logs the ERROR naming itself and
# rank 0 (raises with on_unsynced="raise"). If rank 0 does not come, the others log one WARNING that the check was
# skipped and train on.
# Test: tests/test_guard.py::test_no_hang_when_one_rank_skips_the_check
def check_replicas(tracked: Any, *, every: int = 1, on_divergence: str = "warn",
                   timeout_s: float | None = None) -> bool | None:
    """Compare this rank's fingerprint with its DDP group's rank 0; True: same, False: differs, None: skipped.

    ``every``: the check interval (old store keys are dropped behind it); ``on_divergence``: "raise" raises
    ReplicaDivergenceError, anything else logs one ERROR."""
    mine = fingerprint(tracked.params)
    key, me = _key(tracked, tracked.steps), dist.get_rank()
    try:
        store = rendezvous_store()
        if me == tracked.publisher:
            store.set(key, mine.numpy().tobytes())
            _drop_old_key(store, tracked, every)
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
    _report_divergence(tracked, mine, theirs, on_divergence)
    return False


def _drop_old_key(store, tracked: Any, every: int) -> None:
    """Rank 0 removes the key of the check before the previous one (every reader is long past it)."""
    old = tracked.steps - 2 * (every or 1)
    if old >= 1:
        try:
            store.delete_key(_key(tracked, old))
        except (RuntimeError, AttributeError):  # a store without delete_key: the key stays (bytes per check)
            pass


def _report_divergence(tracked: Any, mine: torch.Tensor, theirs: torch.Tensor, on_divergence: str) -> None:
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
               "update, a load on one rank). "
               "(NOTE [Replica check without a collective] in ddp_patches/replica_check.py)")
    if on_divergence == "raise":
        raise ReplicaDivergenceError(message)
    logger.error("%s", message)


def _bits(value: torch.Tensor) -> bytes:
    return struct.pack("<d", float(value))


def _relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0
