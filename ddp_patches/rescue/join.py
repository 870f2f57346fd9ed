"""Join and manual finalization kept in step with the rescue: ``patch_join_hook`` makes a joined rank issue the
count-all-reduce its peers issue; ``patch_finalize_backward`` runs the reset after torch >= 2.15's
``finalize_backward()``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.join import JoinHook

from .. import probes
from .._registry import REGISTRY
from .counts import _reducer_prepared
from .edges import UnusedParameterEdges, for_ddp


class _JoinShadow(JoinHook):
    """DDP's join hook, followed by the count-all-reduce its peers issue
    (NOTE [One collective per reduction, on every rank])."""

    def __init__(self, inner: JoinHook, ddp: nn.Module, edges: UnusedParameterEdges) -> None:
        self.inner, self.ddp, self.edges = inner, ddp, edges

    def main_hook(self) -> None:
        self.inner.main_hook()
        # DDP's main_hook has just learnt from the peers' forward whether they synchronise this backward.
        if _reducer_prepared(self.ddp) and self.edges.settles(self.ddp):
            self.edges.shadow_in_join(self.ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.inner.post_hook(is_last_joiner)


def _patched_join_hook(original_join_hook):
    def join_hook(self, **kwargs):
        hook = original_join_hook(self, **kwargs)
        edges = for_ddp(self)
        return hook if edges is None else _JoinShadow(hook, self, edges)

    return join_hook


# NOTE [Manual finalization]
# torch 2.15's ``ddp.require_manual_backward_finalization = True`` leaves the reducer's write-back of the averaged
# gradients to the user's ``ddp.finalize_backward()``, after the backward returns (or from a hook once every bucket
# is ready). The count-all-reduce is still issued at the end of the backward, in the same place in the sequence of
# collectives, but setting ``.grad = None`` before the write-back would be undone by it: so the reset waits for
# ``finalize_backward()`` (wrapped on the class), or runs at the end of the backward when a hook already called it.
# Test: tests/test_reach_protocol.py::test_torch_2_15_ddp_options_with_a_parameter_no_rank_used.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _patched_finalize_backward(original_finalize_backward):
    def finalize_backward(self):
        original_finalize_backward(self)
        edges = for_ddp(self)
        if edges is not None:
            edges.backward_finalized()

    return finalize_backward


def patch_finalize_backward() -> list[str]:
    """Where DDP has manual backward finalization (torch >= 2.15)."""
    from torch.nn.parallel import DistributedDataParallel

    if "finalize_backward" not in vars(DistributedDataParallel):
        return []
    REGISTRY.install(DistributedDataParallel, "finalize_backward", _patched_finalize_backward)
    return ["DistributedDataParallel.finalize_backward"]


def patch_join_hook() -> list[str]:
    """``DistributedDataParallel.join_hook`` also shadows the count-all-reduce on a joined rank."""
    from torch.nn.parallel import DistributedDataParallel

    REGISTRY.install(DistributedDataParallel, "join_hook", _patched_join_hook)
    return ["DistributedDataParallel.join_hook"]


# -- what the join patch assumes (NOTE [Probed assumptions] in ddp_patches/probes.py) ---------------------------
def _check_join_hook() -> None:
    """DDP's join hook shadows a backward's bucket all-reduces in ``main_hook`` and records there whether the
    peers synchronise it (what ``_JoinShadow`` reads)."""
    from torch.nn.parallel import distributed

    probes.source_mentions(distributed, "def join_hook", "class _DDPJoinHook", "def main_hook",
                           "require_forward_param_sync = should_sync_backwards")


ASSUMPTIONS = (
    probes.Assumption("join-hook", "DistributedDataParallel.join_hook returns a JoinHook whose main_hook sets "
                      "require_forward_param_sync (NOTE [One collective per reduction, on every rank])",
                      _check_join_hook),
)
