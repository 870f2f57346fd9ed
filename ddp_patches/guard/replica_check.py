"""The replica check: before an optimizer step, each rank publishes a fingerprint of its trainable parameters in the
rendezvous store and compares it, without waiting, with the records of its DDP group's rank 0 (rank 0: of every
rank) already there; a drift is reported by the first parameter that differs.

Called by the guard (``ddp_patches.guard``), which tracks each DDP and counts its optimizer steps; ``tracked`` below
is the guard's record of one DDP. The check runs only where the DDP's communication hook keeps replicas equal.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")

DEFAULT_REPLICA_CHECK_EVERY = 100  # the cost at this interval: benchmarks/guard.py
# The longest a wait of the gradient comparison may last, once per segment: reached only where a partner breaks the
# pairing the waits rely on (point 4 of NOTE [A store wait has a partner that will come])
REPLICA_CHECK_TIMEOUT_S = 60.0
SYNCED = b"synced"  # the gradient record of a rank whose step applies gradients DDP averaged (no fingerprint)
_ABSENT = b"\x00ddp_patches: no such key"  # compare_set's answer for a key that is not there (no record looks so)


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
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9
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
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9
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
            "(NOTE [Replica check only where DDP promises equal replicas] in ddp_patches/guard/replica_check.py)",
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
        if not values:  # nothing to fingerprint (no gradient at this step): an empty record, equal to any other
            return torch.zeros(0, dtype=torch.float64)
        return torch.stack(values).cpu()


def rendezvous_store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# -- the store protocol of both checks ---------------------------------------------------------------------------
def check_step(tracked: Any) -> int:
    """This DDP's optimizer steps in its current segment: what both checks count and key by
    (NOTE [Join ends a segment of step counts] in ddp_patches/guard/steps.py)."""
    return tracked.steps - tracked.segment_base


def segment_key(tracked: Any, *parts: Any) -> str:
    return "/".join([tracked.key_prefix, str(tracked.segment), *map(str, parts)])


def count_step(tracked: Any, optimizer: int = 0) -> None:
    """One more optimizer step of this DDP (the outermost only; ``optimizer``: its id), and whether this rank may
    wait in the store at it (NOTE [A store wait has a partner that will come])."""
    tracked.steps += 1
    tracked.anchored = tracked.synced_forwards != tracked.forwards_at_step
    tracked.forwards_at_step = tracked.synced_forwards
    tracked.synced_in_segment = tracked.synced_in_segment or tracked.anchored
    # The other optimizers of the same iteration (one per layer group, say) step after the same synchronised
    # backward on every rank: partnered as the first; an optimizer stepping again without one starts no iteration.
    same_iteration = not tracked.anchored and optimizer not in tracked.iteration_optimizers \
        and bool(tracked.iteration_optimizers)
    if tracked.anchored:
        tracked.iteration_optimizers = {optimizer}
    elif same_iteration:
        tracked.iteration_optimizers.add(optimizer)
    else:
        tracked.iteration_optimizers = set()
    tracked.may_wait = tracked.anchored or same_iteration or not tracked.synced_in_segment


def gradients_due(tracked: Any, every: int) -> bool:
    """The steps at which every rank writes its gradient record (NOTE [Confirmed before it speaks] in guard.py)."""
    step = check_step(tracked)
    return step <= 2 or step % (every or DEFAULT_REPLICA_CHECK_EVERY) == 0


def write_record(store: Any, tracked: Any, key: str, value: bytes) -> None:
    store.set(key, value)
    tracked.records.append((check_step(tracked), key))


def forget_records(store: Any, tracked: Any, before: int | None = None) -> None:
    """Delete the records this rank wrote for ``tracked`` at steps before ``before`` (None: all of them). Only where
    every reader is past them: at an anchored step, after this rank's fingerprint came to the host (the host copy
    waits for the all-reduce every peer joined after reading them), or once a Join is over."""
    keep = []
    for step, key in tracked.records:
        if before is not None and step >= before:
            keep.append((step, key))
            continue
        try:
            store.delete_key(key)
        except (RuntimeError, AttributeError):  # a store without delete_key: the key stays (bytes per check)
            pass
    tracked.records = keep


def say_left(tracked: Any) -> None:
    """This rank steps no more in this segment (out of data under Join): its partners must not wait for it."""
    try:
        store = rendezvous_store()
        write_record(store, tracked, segment_key(tracked, "left", dist.get_rank()), str(check_step(tracked)).encode())
    except (RuntimeError, AttributeError, ValueError) as exc:
        logger.debug("ddp_patches: %s: could not say in the store that this rank left (%s)", tracked.label, exc)


def new_segment(tracked: Any, *, forget: bool) -> None:
    """A Join this DDP took part in is over, on every rank: its checks count from step 1 again under new keys;
    ``forget``: the Join's last all-reduce proved every peer past this rank's records, which are deleted."""
    if forget and (tracked.records or tracked.fingerprints):
        try:
            store = rendezvous_store()
            forget_records(store, tracked)
            tracked.fingerprints, old = [], tracked.fingerprints
            for key in old:
                store.delete_key(key)
        except (RuntimeError, AttributeError, ValueError):
            pass
    tracked.records, tracked.fingerprints = [], []
    tracked.segment += 1
    tracked.segment_base = tracked.steps
    tracked.forwards_at_step = tracked.synced_forwards
    tracked.synced_in_segment = False
    tracked.iteration_optimizers = set()
    tracked.left = set()
    tracked.unpaired = False


# NOTE [A store wait has a partner that will come]
# Invariant: a run that trains without the library never stalls in the store: no rank waits for a record that may
# not come (a rank out of data under Join, one that warned already, one that took fewer steps); a comparison may be
# missed instead. The replica check never waits (NOTE [Replica check without a wait]); this is the gradient
# comparison's rule. (1) Every rank of a DDP's group checks at the same steps (1, 2, every Nth of a segment:
# NOTE [Join ends a segment of step counts]) and writes its record at each whatever it found before. (2) A rank
# that steps no more in a segment (out of data under Join) writes "left". (3) A wait ends at the partner's record
# or its "left", and is made only where the partner's next move is one of the two: this DDP synchronised a forward
# since this rank's previous step, or since the first step of this iteration by another optimizer, or none in this
# segment (a loss through `.module`: only these checks pair the ranks). Otherwise a rank reads a record already
# there, or none. (4) A rank that skips a step its peers take after a synchronised backward, or stops without Join
# in a loop of (3)'s second kind, is not waited for longer than REPLICA_CHECK_TIMEOUT_S, once per segment.
# Test: tests/test_replica_check.py::test_join_with_uneven_inputs_trains_as_without_the_library_with_no_wait
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9
def read_partner(store: Any, tracked: Any, key: str, partner: int, what: str,
                 timeout_s: float | None = None) -> bytes | None:
    """The partner's record under ``key``, or None where it is not compared
    (NOTE [A store wait has a partner that will come])."""
    if partner in tracked.left:
        return None
    theirs = _peek(store, key)
    if theirs is not None:
        return theirs
    if not tracked.may_wait or tracked.unpaired:
        logger.debug("ddp_patches: rank %d: %s before its optimizer step %d: rank %d's record is not there and "
                     "nothing ties this step to it; not compared", dist.get_rank(), what, tracked.steps, partner)
        return None
    timeout = REPLICA_CHECK_TIMEOUT_S if timeout_s is None else timeout_s
    left, deadline, pause = segment_key(tracked, "left", partner), time.monotonic() + timeout, 0.0002
    while True:
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
        theirs = _peek(store, key)
        if theirs is not None:
            return theirs
        if store.check([left]):
            tracked.left.add(partner)  # out of data under Join: nothing more to compare in this segment
            return None
        if time.monotonic() > deadline:
            break
    tracked.unpaired = True
    logger.warning(
        "ddp_patches: rank %d: %s before its optimizer step %d skipped: rank %d did not reach this check within "
        "%.0f s (it skipped an optimizer step the others took, or stopped without torch's Join, or it is stalled); "
        "training goes on, and this rank waits no more for %s's checks until a Join starts its step counts over",
        dist.get_rank(), what, tracked.steps, partner, timeout, tracked.label)
    return None


def _peek(store: Any, key: str) -> bytes | None:
    """The value under ``key``, or None, without waiting: ``get`` waits for a missing key, and ``check`` then
    ``get`` races with the writer deleting it (a blocked read); ``compare_set`` with an expected value no record
    has returns the value, or that expected value where there is none, and changes nothing."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


# NOTE [Replica check without a wait]
# Invariant: the check never blocks and never touches the training collectives, also when ranks disagree about
# stepping (one skips a step its peers take, one runs out of data, one raised): a wait may have no partner, and a
# collective on the training group would be a mismatched one (under NCCL a hang).
# Rule: through the rendezvous store. At its check of step k (of the segment) each rank writes its fingerprint
# under a key named by the DDP, segment, step and rank, then reads once, without waiting, its partners' records for
# k (rank 0: every rank's; others: rank 0's) and compares those there. Store operations are ordered, so of two
# ranks that both check step k the later one finds the other's record and compares (a rank that skipped a step its
# peers took, later). A difference: one ERROR on the rank that compared (ReplicaDivergenceError with "raise"). A
# rank keeps its last KEPT_FINGERPRINTS records; never compared: a partner further behind, or one that never
# reaches k (stopped, out of data under Join; the last check of a run).
# Test: tests/test_replica_check.py::test_rank0_skipping_a_step_stalls_nothing_and_the_drift_is_reported
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9
def check_replicas(tracked: Any, *, every: int = 1, on_divergence: str = "warn",
                   timeout_s: float | None = None) -> bool | None:
    """Publish this rank's fingerprint and compare it with the partners' already there
    (NOTE [Replica check without a wait]); True: all compared are the same, False: one differs, None: none there.

    ``every`` and ``timeout_s``: unused (the check neither waits nor counts on a schedule of deletions);
    ``on_divergence``: "raise" raises ReplicaDivergenceError, anything else logs one ERROR."""
    mine = fingerprint(tracked.params)  # on the host: after the all-reduce this step is anchored by, if any
    step, me = check_step(tracked), dist.get_rank()
    partners = [r for r in tracked.group_ranks if r != me] if me == tracked.publisher else [tracked.publisher]
    found = []
    try:
        store = rendezvous_store()
        if tracked.anchored:
            forget_records(store, tracked, before=step)  # the gradient records (NOTE [Confirmed before it speaks])
        _publish(store, tracked, segment_key(tracked, "fp", step, me), mine.numpy().tobytes())
        for partner in partners:
            theirs = _peek(store, segment_key(tracked, "fp", step, partner))
            if theirs is not None:
                found.append((partner, torch.frombuffer(bytearray(theirs), dtype=torch.float64)))
    except (RuntimeError, AttributeError, ValueError) as exc:  # no usable rendezvous store: never fail a step for it
        tracked.no_store = True
        log_rank0_once(f"guard-no-store-{tracked.index}", logging.WARNING,
                       "ddp_patches: replica check off for %s: the process group's rendezvous store is not usable "
                       "here (%s)", tracked.label, exc)
        return None
    if not found:
        return None
    mine_bits = mine.numpy().tobytes()
    differ = [(partner, theirs) for partner, theirs in found
              if theirs.numel() != mine.numel() or theirs.numpy().tobytes() != mine_bits]
    apart = {partner for partner, _ in differ}
    if differ and (apart - tracked.drifted or on_divergence == "raise"):  # a partner not reported apart yet
        _report_divergence(tracked, mine, differ, on_divergence)
    together = sorted(tracked.drifted & {partner for partner, _ in found} - apart)
    tracked.drifted = tracked.drifted - set(together) | apart
    if together:
        logger.warning("ddp_patches: rank %d: replica check before optimizer step %d of %s: this rank's parameters "
                       "equal rank(s) %s's again (NOTE [One ERROR per drift] in ddp_patches/guard/replica_check.py)",
                       me, tracked.steps, tracked.label, ", ".join(map(str, together)))
    if differ:
        return False
    return True


# NOTE [One ERROR per drift]
# Invariant: a drift is reported once, where it is first seen, and its end is reported too; a log does not fill with
# the same ERROR at every later check of a run whose replicas, once apart, stay apart (they do unless reloaded).
# Rule: per partner a rank compares with (the later of two ranks at a step count compares): a partner found apart
# for the first time logs the ERROR (with on_unsynced="raise", each comparison that differs raises); one already
# apart says nothing more; one apart before and now equal logs one WARNING naming it, and may drift again, anew.
# A partner whose record was not there to compare says nothing either way (three ranks, one of them apart).
# Test: tests/test_replica_check.py::test_a_drift_is_reported_once_and_its_end_too
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9


KEPT_FINGERPRINTS = 4  # per rank and DDP: how many checks a partner may lag and still be compared


def _publish(store: Any, tracked: Any, key: str, value: bytes) -> None:
    store.set(key, value)
    tracked.fingerprints.append(key)
    while len(tracked.fingerprints) > KEPT_FINGERPRINTS:
        old = tracked.fingerprints.pop(0)
        try:
            store.delete_key(old)
        except (RuntimeError, AttributeError):  # a store without delete_key: the key stays (bytes per check)
            pass


def _report_divergence(tracked: Any, mine: torch.Tensor, differ: list[tuple[int, torch.Tensor]],
                       on_divergence: str) -> None:
    me = dist.get_rank()
    peer, theirs = differ[0]
    names = list(tracked.names.values())
    if theirs.numel() != mine.numel():
        detail = f"rank {peer} has {theirs.numel() // 2} trainable parameters, this rank {len(names)}"
    else:
        diff = [i for i in range(len(names))
                if _bits(mine[2 * i]) != _bits(theirs[2 * i]) or _bits(mine[2 * i + 1]) != _bits(theirs[2 * i + 1])]
        i = diff[0]
        mine_sum, their_sum = float(mine[2 * i]), float(theirs[2 * i])
        mine_norm, their_norm = float(mine[2 * i + 1]), float(theirs[2 * i + 1])
        detail = (f"first differing parameter '{names[i]}': sum {mine_sum:.9g} here vs {their_sum:.9g} on rank "
                  f"{peer} (|diff| {abs(mine_sum - their_sum):.3g}), L2 norm {mine_norm:.9g} vs "
                  f"{their_norm:.9g} (relative diff {_relative(mine_norm, their_norm):.3g}); {len(diff)} of "
                  f"{len(names)} trainable parameters differ")
    others = f" (and from rank(s) {', '.join(str(p) for p, _ in differ[1:])})" if len(differ) > 1 else ""
    message = (f"ddp_patches: rank {me}: replica check before optimizer step {tracked.steps} of {tracked.label}: "
               f"this rank's parameters differ from rank {peer}'s{others}, the DDP replicas have drifted apart "
               f"(compared at the same optimizer step count of each rank): {detail}. Something applied gradients "
               "DDP did not average, or changed parameters on some ranks only (a loss through `.module` after the "
               "last synced micro-step, an optimizer step skipped on some ranks only, a per-rank seed in a "
               "parameter update, a load on one rank). "
               "(NOTE [Replica check without a wait] in ddp_patches/guard/replica_check.py)")
    if on_divergence == "raise":
        raise ReplicaDivergenceError(message)
    logger.error("%s", message)


def _bits(value: torch.Tensor) -> bytes:
    return struct.pack("<d", float(value))


def _relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0
