"""The count-all-reduce after DDP's reduction: which parameters no rank used (their ``.grad`` back to None), which
fired late on some rank only; issued once per reduction on every rank, a joined one included (``shadow_in_join``).
``CountAllReduce`` is the part of ``UnusedParameterEdges`` (ddp_patches/rescue/edges.py) that does it.
"""

from __future__ import annotations

import array
import collections
import itertools
import operator

import torch
from torch import nn

from .. import engines

_SET_GRAD = torch.Tensor.grad.__set__


def _pick(items: list, indices: list) -> tuple:
    """``items[i]`` for each of ``indices``, in one C call."""
    if len(indices) == 1:
        return (items[indices[0]],)
    return operator.itemgetter(*indices)(items) if indices else ()


def _index_tensor(indices: list, device) -> torch.Tensor:
    """``torch.tensor(indices)`` without a Python object per element (``array`` hands its buffer over)."""
    return torch.frombuffer(array.array("q", indices), dtype=torch.int64).to(device)


def needed(ddp: nn.Module) -> bool:
    """Only a reducer that does not search for unused parameters itself needs the rescue. Read per forward."""
    return not ddp.find_unused_parameters or bool(getattr(ddp, "static_graph", False))


def _count_tensor(n: int, no_grad: torch.Tensor | slice | None, late, world: int, device) -> torch.Tensor:
    """Per parameter: 1 where it had no gradient here, plus world + 1 where it fired late here. After the sum over
    ranks, ``value % (world + 1)`` counts the ranks without a gradient and ``value // (world + 1)`` the late ones;
    float32 holds both exactly while (world + 1)^2 < 2^24, float64 beyond."""
    counts = torch.zeros(n, dtype=torch.float32 if world < 4000 else torch.float64, device=device)
    if no_grad is not None:
        counts[no_grad] = 1.0
    if late:
        counts[torch.tensor(late, device=device)] += float(world + 1)
    return counts


# NOTE [One collective per reduction, on every rank]
# Invariant: the count-all-reduce is issued exactly once per reduction DDP itself does, on every rank, after DDP's
# own collectives: a collective one rank issues and another does not pairs with the wrong call (a hang, a gloo
# size error, or with NCCL buffers of equal size mixed silently).
# Rule: a forward after which DDP reduces (grad mode and sync on, or accelerate's ``trigger_sync_in_backward``)
# arms one settle; the FIRST of ``_BackwardStart`` (a backward through the outputs) and a post-hook of the DDP's
# AccumulateGrad nodes (a loss that reaches the parameters but not the outputs, such as
# ``sum(p.sum() for p in params) * 0``) disarms it and settles. Whether it runs is read from what the forward
# decided (below) and from settings equal on every rank (``needed``), never from ``no_sync()`` around the
# backward alone nor from this rank's data.
# Under ``Join``, a rank out of data issues the same all-reduce ("no gradient here" everywhere) right after DDP's
# join hook has shadowed the bucket all-reduces, when the peers synchronise (``_JoinShadow``). The reduced counts
# are read back on the host only by a rank that had a parameter without a gradient.
# Test: tests/test_reach_protocol.py::test_join_with_no_sync_around_the_forward_or_the_backward_only.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _reducer_prepared(ddp: nn.Module) -> bool:
    """Whether the last forward prepared DDP's reducer for a reduction (``require_forward_param_sync``)."""
    return bool(getattr(ddp, "require_forward_param_sync", ddp.require_backward_grad_sync))


class CountAllReduce:
    """The count-all-reduce of one DDP's bookkeeping (``_params``, ``_names``: set by ``UnusedParameterEdges``)."""

    def _refuse_a_mixed_late_fire(self, late: list[int], late_counts: list[float], world: int, context: str,
                                  may_nest: str | None) -> None:
        """NOTE [Unused parameters marked where DDP marks them]: a parameter fired at the end of the backward here
        but not on every rank had its bucket all-reduced after ``context``'s collective here and before it
        elsewhere: this step's gradients cannot be trusted, so the backward fails before any optimizer step."""
        mixed = [i for i, n in zip(late, late_counts) if n < world]
        if not mixed:
            return  # fired at the end on every rank: the same place in the sequence everywhere
        raise RuntimeError(
            f"ddp_patches: {len(mixed)} trainable parameter(s) of this DistributedDataParallel (e.g. "
            f"'{self._names[mixed[0]]}') got no gradient on this rank, and a custom autograd Function in its graph "
            f"({may_nest}) may reach parameters in a nested backward, so their DDP hooks fired at the end of the "
            f"backward here but earlier on other ranks, while {context}: their buckets may have been all-reduced "
            "with the wrong collective, so this step's gradients are not trusted. Give this DDP its own group "
            "(process_group=torch.distributed.new_group(...)), or pass find_unused_parameters=True, or make the "
            "Function non-reentrant (NOTE [Unused parameters marked where DDP marks them] in "
            "ddp_patches/rescue/graph.py).")

    # NOTE [Unused everywhere ends with grad None]
    # Invariant: a parameter that no rank used in a synced step ends with ``.grad`` None, as with
    # find_unused_parameters=True and in a single process, so AdamW's weight decay and momentum leave it alone.
    # Rule: after the reducer has written its averages (a second callback, queued behind DDP's own finalize), one
    # all-reduce of one float per trainable parameter over the DDP's group counts the ranks on which it had no
    # gradient before ``_settle`` fired it; where that count is the world size, ``.grad`` is set back to None.
    # When it runs: NOTE [One collective per reduction, on every rank].
    # Test: tests/test_reach.py::test_unused_everywhere_ends_with_grad_none_and_adamw_matches_find_unused.
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
    def _reset_unused_everywhere(self, ddp: nn.Module, no_grad: list[int], late: list[int] = (),
                                 context: str | None = None) -> None:
        """NOTE [Unused everywhere ends with grad None]; read back only where this rank had a parameter without
        a gradient (NOTE [One collective per reduction, on every rank]). The second half counts, per parameter, the
        ranks that fired it at the end of the backward (NOTE [Unused parameters marked where DDP marks them])."""
        group = getattr(ddp, "process_group", None)
        world = torch.distributed.get_world_size(group)
        device = self._params[0].device
        no_grad_index = _index_tensor(no_grad, device) if no_grad else None
        counts = _count_tensor(len(self._params), no_grad_index, late, world, device)
        torch.distributed.all_reduce(counts, group=group)
        finalized, self._finalized_in_backward = self._finalized_in_backward, False
        if late and context is not None:  # read back only where a late fire met another collective
            late_counts = (counts[late] // (world + 1)).tolist()
            self._refuse_a_mixed_late_fire(late, late_counts, world, context, self._culprit)
        if not no_grad:
            return  # every parameter had a gradient here, so none is unused everywhere: nothing to read back
        # On the device, read back at the reset: unused on every rank where the count of ranks without it is world.
        self._pending_reset = no_grad_index[torch.remainder(counts[no_grad_index], world + 1) == world]
        if finalized or not getattr(ddp, "_require_manual_backward_finalization", False):
            self.apply_pending_reset()  # else at the user's finalize_backward(): NOTE [Manual finalization]

    def apply_pending_reset(self) -> None:
        if self._pending_reset is None:
            return
        unused_everywhere = self._pending_reset.tolist()
        self._pending_reset = None
        collections.deque(map(_SET_GRAD, _pick(self._params, unused_everywhere), itertools.repeat(None)), 0)

    def backward_finalized(self) -> None:
        """The user called ``finalize_backward()`` (torch >= 2.15, manual finalization): the reducer has written
        the averages now. From a hook inside the backward, the reset follows at its end."""
        if torch._C._current_graph_task_id() != -1:
            self._finalized_in_backward = True
        else:
            self.apply_pending_reset()

    def settles(self, ddp: nn.Module) -> bool:
        """Whether a synced backward of ``ddp`` ends with the count-all-reduce: settings equal on every rank."""
        return bool(self._params) and not self._retired and needed(ddp) and not engines.compiling()

    def shadow_in_join(self, ddp: nn.Module) -> None:
        """On a rank that joined: the count-all-reduce its peers issue, with "no gradient here" everywhere."""
        group = getattr(ddp, "process_group", None)
        n = len(self._params)
        counts = _count_tensor(n, slice(None), [], torch.distributed.get_world_size(group), self._params[0].device)
        torch.distributed.all_reduce(counts, group=group)  # no gradient anywhere here; fired late nowhere
