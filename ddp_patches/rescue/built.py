"""What runs when a DistributedDataParallel is built under apply(): the one patch of its ``__init__``.

The reducer patches (``rescue.reducer.install``) turn on the rescue's steps, apply() the guard's tracking;
``install`` patches the constructor once, and the steps run in one order, whichever part was turned on first:
NOTE [One owner of DDP.__init__]. Settings are logged once on rank 0 at INFO.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import checkpointing, chunked_loss, engines, tiled_mlp
from .._registry import REGISTRY
from ..distributed import is_distributed, log_rank0_once
from ..guard import unsynced as guard
from . import edges, graph, teardown, trainable_set
from .counts import needed

TARGET = "DistributedDataParallel.__init__"

# The DDP settings worth reporting in the one log line.
_REPORTED = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb")

_parts = {"rescue": False, "guard": False}  # what install() turned on; cleared by revert()


def _forget() -> None:
    _parts.update(rescue=False, guard=False)


REGISTRY.on_reset(_forget)  # NOTE [Each module forgets its own state]


# NOTE [One owner of DDP.__init__]
# Invariant: what runs when a DDP is built under apply() runs in one order, whichever part was installed first.
# Rule: only this module patches DistributedDataParallel.__init__. The rescue (apply(reducer=True), its probe
# passed) runs all but 10 where the guard is off; the guard alone (apply(reducer=False), or the reducer's probe
# stepped aside) runs 2 and 10.
#   1. checkpointing.check_recompute_routing (distributed only: before DDP's first collective, on every rank)
#   2. DDP's own __init__, with the settings as given (NOTE [find_unused is the user's]); then distributed only:
#   3. engines.own  4. tiled_mlp.discover  5. chunked_loss.note_fused
#   6. the trainable-set guard's hooks (before the rescue's: they see DDP's own outputs)
#   7. graph.watch_custom_functions (once)  8. edges.install  9. teardown.track  10. guard.track  11. the settings line
# Test: tests/test_guard.py::test_the_guard_watches_a_ddp_built_under_reducer_false
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §4
def install(*, rescue: bool = False, guard_tracking: bool = False) -> list[str]:
    """Turn on the rescue's steps or the guard's tracking; patch the constructor on the first call."""
    _parts["rescue"] |= rescue
    _parts["guard"] |= guard_tracking
    if REGISTRY.is_patched(DDP, "__init__"):
        return []
    REGISTRY.install(DDP, "__init__", _patched_ddp_init)
    return [TARGET]


# NOTE [find_unused is the user's]
# Invariant: DistributedDataParallel is built with exactly the settings it was given (by the user, the Trainer, TRL
# or accelerate): the library never changes find_unused_parameters or static_graph.
# Rule: what find_unused_parameters=True is for -- a trainable parameter without a gradient on some rank -- is
# handled by ``ddp_patches.rescue``, and only where the reducer does not search itself. Forcing the flag would
# break working patterns: under accelerate's ``trigger_sync_in_backward``, prepare_for_backward([]) marks every
# parameter unused and its real hook then marks it again ("marked as ready twice"); a PowerSGD hook's ranks fall out
# of step; and every step pays an extra all-reduce and loses the bucket rebuild. With non-reentrant checkpointing
# (ddp_patches.checkpointing) both values of the flag and static_graph train.
# Test: tests/test_reach.py::test_ddp_settings_are_passed_through_untouched
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §4
def _patched_ddp_init(original_init):
    def __init__(self, *args, **kwargs):
        rescue = _parts["rescue"]
        module = args[0] if args else kwargs.get("module")
        if rescue and is_distributed() and isinstance(module, torch.nn.Module):
            checkpointing.check_recompute_routing(module)  # before DDP's first collective, on every rank alike
        original_init(self, *args, **kwargs)  # the settings as given: NOTE [find_unused is the user's]
        if not is_distributed():
            return
        if rescue:
            engines.own(self)  # NOTE [The engine is the module's owner's]
            tiled_mlp.discover(self.module)  # no-op unless apply(tiled_mlp=True): NOTE [MLPs found by structure]
            # no-op unless apply(chunked_loss=True): NOTE [When the chunked loss acts]
            chunked_loss.note_fused(self.module)
            trainable_set.TrainableGuard(self).install(self)  # before reach: its hooks see DDP's own outputs
            graph.watch_custom_functions()  # once, at the first DDP: NOTE [No walk without a custom Function]
            edges.install(self)
            teardown.track(self)
        if rescue or _parts["guard"]:
            guard.track(self)  # no-op unless the guard is on (ddp_patches/guard/)
        if rescue:
            _log_settings(self, needed(self))

    return __init__


def _log_settings(ddp: DDP, rescued: bool) -> None:
    settings = ", ".join(f"{k}={getattr(ddp, k, None)}" for k in _REPORTED if hasattr(ddp, k))
    how = ("a parameter without a gradient fires its hook once at the end of backward (ddp_patches.rescue)"
           if rescued else "unused parameters are found by DDP itself")
    log_rank0_once(f"ddp-settings:{settings}", logging.INFO,
                   "ddp_patches: DistributedDataParallel built with %s (as given); %s", settings, how)
