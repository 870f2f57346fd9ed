"""The guard's optimizer step hooks (torch's global step pre- and post-hooks): before each outermost step, the
unsynchronised-gradient check (``UnsynchronizedGradientsError`` with ``on_unsynced="raise"``, else one WARNING per
rank) and the replica check (``replica_check``) for the DDPs ``unsynced`` tracks; Join's exit starts a new segment
of step counts. ``install`` registers them (the DDP tracking is turned on in ddp_patches/rescue/built.py).
"""

from __future__ import annotations

import itertools
import logging
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import engines
from .._registry import REGISTRY
from ..distributed import is_distributed
from . import replica_check
from .unsynced import (TARGETS, UnsynchronizedGradientsError, _by_ddp, _owner, _owners_changed, _settings,
                       _Tracked)

logger = logging.getLogger("ddp_patches")


# -- the optimizer step hooks ----------------------------------------------------------------------------------
# NOTE [Only the outermost step]
# An optimizer may step another inside its step (ZeroRedundancyOptimizer steps a local optimizer over this rank's
# shard). Only the outermost step is checked and counted: the inner one's parameters are a per-rank subset (a rank
# whose shard holds none of a DDP's parameters would count fewer steps than its peers, and the replica checks would
# then compare different steps), and the outer step already covered every parameter. Depth is kept by the pre- and
# post-hooks; a step that raised skips its post-hook, so a pre-hook of the very optimizer recorded as outermost
# means that depth is stale and starts over.
# Test: tests/test_guard.py::test_zero_redundancy_optimizer_is_silent
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §8
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


# NOTE [The step check without a walk per step]
# Invariant: a step's check costs what the backward wrote since the last step, not the optimizer's size (10k
# tensors walked in Python took milliseconds per step), and reports exactly what the walk would.
# Rule: an optimizer's view (its parameters, their ids, the DDPs owning them) is kept until its parameter lists
# hold other objects (compared by identity, at C speed, allocating nothing) or the owner map changed. Per DDP, its
# written parameters in the optimizer: all it wrote where the optimizer holds the whole DDP, else filtered. Every
# baseline is at most ``forwards_at_step`` (both are taken at this DDP's steps): where a synchronised forward ran
# since then, none of them is a suspect and their baselines move up in one update; otherwise they are judged one
# by one, in the optimizer's order, as NOTE [Which gradients DDP never averaged] says.
# Test: tests/test_guard.py::test_correct_patterns_are_silent
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §8
@dataclass(eq=False)
class _View:
    groups: list  # a copy of each parameter group's list of parameters
    ids: list  # id of every parameter of the optimizer, in its order
    id_keys: dict  # the same ids as keys: a dict, not a set (ids are addresses, whose low bits collide in a set)
    touched: list  # the tracked DDPs owning some of them, in order of first appearance
    whole: set  # indices of those all of whose parameters the optimizer holds
    owners_changed: int


_views: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _View]" = weakref.WeakKeyDictionary()


def _same_parameters(view: _View, param_groups: list) -> bool:
    return len(view.groups) == len(param_groups) and all(
        len(kept) == len(group["params"]) and all(map(operator.is_, kept, group["params"]))
        for kept, group in zip(view.groups, param_groups))


def _view(optimizer: torch.optim.Optimizer) -> _View:
    try:
        view = _views.get(optimizer)
    except TypeError:  # not weakly referenceable: no cache
        view = None
    if view is not None and view.owners_changed == _owners_changed[0] \
            and _same_parameters(view, optimizer.param_groups):
        return view
    groups = [list(group["params"]) for group in optimizer.param_groups]
    ids = list(map(id, itertools.chain.from_iterable(groups)))
    touched = [t for t in dict.fromkeys(map(_owner.get, ids)) if t is not None]
    keys = dict.fromkeys(ids)
    whole = {t.index for t in touched if all(id(p) in keys for p in t.params)}
    view = _View(groups, ids, keys, touched, whole, _owners_changed[0])
    try:
        _views[optimizer] = view
    except TypeError:
        pass
    return view


def _check_step(optimizer: torch.optim.Optimizer) -> None:
    view = _view(optimizer)
    touched: dict[int, _Tracked] = {t.index: t for t in view.touched}
    unsynced: dict[int, tuple[_Tracked, str]] = {}
    for tracked in view.touched:
        written = tracked.written
        if not written:
            continue
        # the written ones of this optimizer: all of them where it holds the whole DDP (no lookup per parameter)
        mine = written if tracked.index in view.whole else list(filter(view.id_keys.__contains__, written))
        if not mine:
            continue
        forwards = tracked.synced_forwards
        if forwards != tracked.forwards_at_step:  # NOTE [The step check without a walk per step]
            # Pairs straight into the baseline: a temporary dict of the written ids (a fresh table) cost about 1 ms
            # per step at 1,600 written tensors.
            tracked.baseline.update(zip(mine, itertools.repeat(forwards)))
            if len(mine) == len(written):
                written.clear()
            else:
                for pid in mine:
                    del written[pid]
            continue
        for pid in view.ids:
            if pid not in written:  # not written, another DDP's, or listed twice
                continue
            averaged = written.pop(pid)
            synced_since = forwards != tracked.baseline.get(pid, 0) or averaged
            tracked.baseline[pid] = forwards
            if not synced_since and not tracked.stepped_aside and tracked.index not in unsynced:
                unsynced[tracked.index] = (tracked, tracked.names[pid])
    every = _settings.replica_check_every
    for tracked in touched.values():
        replica_check.count_step(tracked, id(optimizer))
    if _settings.on_unsynced != "off":
        due = [t for t in touched.values() if replica_check.gradients_due(t, every)]
        for tracked in _gradients_differ(due, unsynced, optimizer):
            _report_unsynced(tracked, unsynced[tracked.index][1])
    for tracked in touched.values():
        if replica_check.due(replica_check.check_step(tracked), every) and not tracked.no_store \
                and replica_check.promised_equal(tracked):
            replica_check.check_replicas(tracked, every=every, on_divergence=_settings.on_unsynced)


# NOTE [Confirmed before it speaks]
# Invariant: the forward count says only that DDP did not average a backward; gradients averaged another way
# (``no_sync()`` micro-steps, then ``dist.all_reduce(p.grad); p.grad /= world`` by hand) are correct and are never
# reported.
# Rule: a step the count calls unsynchronised is reported only if the gradients really differ, compared through the
# store at the steps every rank checks (1, 2, every ``replica_check_every``-th, 100 where that is 0, of a segment):
# there the group's first two ranks write a fingerprint of the gradients this optimizer is about to apply for the
# DDP (per parameter, float64 sum and L2 norm, in the optimizer's order; "synced" where DDP averaged them), also
# once they warned; a rank that has not warned reads one partner's (rank 0 its group's second rank, every other
# rank rank 0) and compares bit for bit, no collective (NOTE [A store wait has a partner that will come]). Not
# compared: never a verdict. Different: reported on every rank whose gradients differ, once per DDP.
# Test: tests/test_guard.py::test_hand_averaging_left_out_later_is_reported
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §8
def _gradients_differ(due: list[_Tracked], unsynced: dict[int, tuple[_Tracked, str]],
                      optimizer: torch.optim.Optimizer) -> list[_Tracked]:
    """The DDPs among ``due`` whose gradients on this rank differ from its partner's; every record this rank owes
    its partners is written first (NOTE [Confirmed before it speaks])."""
    me = dist.get_rank()
    reads = []
    for tracked in due:
        ranks, want = tracked.group_ranks, tracked.index in unsynced and not tracked.warned
        if len(ranks) < 2:
            reads += [(tracked, None, None)] if want else []  # no partner: the count alone speaks
            continue
        if me not in ranks[:2] and not want:
            continue  # nobody reads this rank's record, and it asks nothing
        if tracked.index in unsynced:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                     if _owner.get(id(p)) is tracked and p.grad is not None]
            mine = replica_check.fingerprint(grads).numpy().tobytes()
        else:
            mine = replica_check.SYNCED
        step = replica_check.check_step(tracked)
        try:
            if me in ranks[:2]:
                replica_check.write_record(replica_check.rendezvous_store(), tracked,
                                           replica_check.segment_key(tracked, "grads", step, me), mine)
        except (RuntimeError, AttributeError, ValueError) as exc:
            _not_compared(tracked, ranks[1] if me == ranks[0] else ranks[0], exc)
            continue
        if want:
            reads.append((tracked, step, mine))
    differ = []
    for tracked, step, mine in reads:
        if step is None:
            differ.append(tracked)
            continue
        ranks = tracked.group_ranks
        partner = ranks[1] if me == ranks[0] else ranks[0]
        try:
            theirs = replica_check.read_partner(
                replica_check.rendezvous_store(), tracked, replica_check.segment_key(tracked, "grads", step, partner),
                partner, f"the gradient comparison of {tracked.label}")
        except (RuntimeError, AttributeError, ValueError) as exc:
            _not_compared(tracked, partner, exc)
            continue
        if theirs is not None and theirs != replica_check.SYNCED and theirs != mine:
            differ.append(tracked)
    return differ


def _not_compared(tracked: _Tracked, partner: int, exc: BaseException) -> None:
    logger.warning("ddp_patches: rank %d: %s: could not compare gradients with rank %d before optimizer step %d (%s); "
                   "the unsynchronised-gradient check is skipped for this step", dist.get_rank(), tracked.label,
                   partner, tracked.steps, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


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
        "generation. (NOTE [Which gradients DDP never averaged] in ddp_patches/guard/unsynced.py; "
        "apply(on_unsynced='raise') makes this an error, 'off' silences it.)"
    )
    if _settings.on_unsynced == "raise":
        raise UnsynchronizedGradientsError(message)
    if not tracked.warned:  # once per DDP and process: a run that does this does it every step
        tracked.warned = True
        logger.warning("%s", message)


# -- torch's Join ----------------------------------------------------------------------------------------------
# NOTE [Join ends a segment of step counts]
# Invariant: under torch's Join a rank out of data stops stepping while its peers go on (DDP's join hook shadows
# their collectives); after the Join their step counts differ for good, though their parameters agree again (the
# hook broadcasts the last joiner's). Counting on would pair different steps: a wait for a step its partner takes
# much later (a stall), or a comparison with parameters of another step (a false "drifted apart").
# Rule: a rank entering Join's exit with its data done writes "left" for each watched DDP of that Join (a peer's
# wait ends there: NOTE [A store wait has a partner that will come]). When the Join is over, on every rank, each of
# its DDPs starts a new segment: the checks count from step 1 again, under the segment's keys, and the rank deletes
# what it wrote in the old one (every peer is past it: Join's loop ends with an all-reduce every rank joined).
# Test: tests/test_replica_check.py::test_join_then_steps_in_step_are_checked_again_and_a_drift_is_caught
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §9
def _watched(join: Any) -> list[_Tracked]:
    found = []
    for joinable in getattr(join, "_joinables", ()):
        tracked = _by_ddp.get(id(joinable))
        if tracked is not None and tracked.ddp() is joinable:
            found.append(tracked)
    return found


def _join_exit(original_exit):
    def __exit__(self, exc_type, exc, traceback):
        watched = _watched(self) if is_distributed() else []
        shadows = exc_type is None and bool(getattr(self, "_enable", True))  # the loop of all-reduces runs
        if shadows:
            for tracked in watched:
                replica_check.say_left(tracked)
        over = False
        try:
            result = original_exit(self, exc_type, exc, traceback)
            over = shadows
            return result
        finally:
            for tracked in watched:
                replica_check.new_segment(tracked, forget=over)

    return __exit__


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
        _owners_changed[0] += 1
        _by_ddp.clear()
        _views.clear()
        _nesting["depth"] = 0


def install(*, on_unsynced: str, replica_check_every: int) -> list[str]:
    """Register the global optimizer step hooks and Join's exit. Nothing when both are off; apply() then turns on
    the tracking of every DDP built from now on (NOTE [One owner of DDP.__init__] in ddp_patches/rescue/built.py)."""
    if on_unsynced == "off" and not replica_check_every:
        return []
    _settings.on_unsynced = on_unsynced
    _settings.replica_check_every = replica_check_every
    _settings.active = True
    REGISTRY.add_handle(_Handles())
    installed = list(TARGETS)
    from torch.distributed.algorithms.join import Join

    REGISTRY.install(Join, "__exit__", _join_exit)  # NOTE [Join ends a segment of step counts]
    installed.append("torch.distributed.algorithms.join.Join.__exit__")
    return installed
