"""The reducer patches of apply(reducer=True): ``install`` turns on what runs when a DDP is built (``built``: the
unused-parameter rescue, the trainable-set guard, teardown), patches Join and manual finalization (``join``) and
``destroy_process_group`` (``teardown``), and makes ``no_sync()`` leave the first backward of a static graph
synced (NOTE [static graph first step]). What these patches assume of torch is probed first.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import probes
from .._registry import REGISTRY
from ..distributed import is_distributed, log_rank0_once
from . import built, edges, join, teardown, trainable_set
from .edges import _FireHooks
from .graph import _ProbeStart

logger = logging.getLogger("ddp_patches")

TARGETS = (built.TARGET, "DistributedDataParallel.no_sync")


def warn_unprotected() -> None:
    """One WARNING when DDP instances built before apply() exist: they got none of the per-instance protection
    (their hooks are installed at construction), and nothing here can add it without a forward of theirs."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # no process group, so no DDP yet: skip the scan
    import gc

    # type(), not isinstance(): the heap holds weak proxies, and isinstance() on a dead one raises
    count = sum(1 for o in gc.get_objects() if issubclass(type(o), DDP) and edges.for_ddp(o) is None)
    if count:
        log_rank0_once("unprotected-ddp", logging.WARNING,
                       "ddp_patches: %d DistributedDataParallel instance(s) were built before apply() and are not "
                       "protected (no unused-parameter rescue, no trainable-set check); call apply() before building "
                       "DDP, the Trainer or accelerator.prepare", count)


# NOTE [static graph first step]
# Invariant: static_graph=True with gradient accumulation never hits "expect_autograd_hooks_ INTERNAL ASSERT FAILED"
# (open upstream). DDP's _DDPSink enqueues reducer._delay_all_reduce after the first backward it sees; under
# no_sync() the forward skipped prepare_for_backward, so that delayed all-reduce finds the reducer not expecting
# hooks. If the first backward is a synced one, later no_sync accumulation works.
# Rule: until DDP records that delayed all-reduce (``_static_graph_delay_allreduce_enqueued``), no_sync() does not
# disable synchronisation. Gradients stay exact because averaging is linear: the first micro-batch's gradient is
# averaged early (identical on every rank), and the later synced backward averages (that average + each rank's
# remaining local sum) to the same total. Cost: one extra all-reduce, in the first optimizer step only.
# Test: tests/test_reducer.py::test_no_sync_is_synced_only_for_the_first_static_graph_backward
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §4
def _needs_synced_first_backward(ddp: DDP) -> bool:
    return bool(getattr(ddp, "static_graph", False)) and not getattr(
        ddp, "_static_graph_delay_allreduce_enqueued", True
    )


def _patched_no_sync(original_no_sync):
    @contextlib.contextmanager
    def no_sync(self):
        if is_distributed() and _needs_synced_first_backward(self):
            log_rank0_once(
                "static-graph-first-sync",
                logging.INFO,
                "ddp_patches: static_graph=True: the first backward is synchronised even under no_sync() "
                "(avoids expect_autograd_hooks_ INTERNAL ASSERT FAILED; see NOTE [static graph first step])",
            )
            yield
            return
        with original_no_sync(self):
            yield

    return no_sync


def _patch_ddp_no_sync() -> None:
    REGISTRY.install(DDP, "no_sync", _patched_no_sync)


# -- what the reducer patches assume (NOTE [Probed assumptions] in ddp_patches/probes.py) -----------------------
def _check_ddp_attributes() -> None:
    """DDP still keeps the settings and state the patches read on the instance (only its source shows them)."""
    probes.source_mentions(DDP, "find_unused_parameters", "static_graph", "require_backward_grad_sync",
                           "parameters_to_ignore", "process_group", "self.reducer", "_active_ddp_module")


def _check_static_graph_flag() -> None:
    probes.source_mentions(DDP, "_static_graph_delay_allreduce_enqueued")


def _check_autograd_hooks() -> None:
    """A post-hook on a leaf's AccumulateGrad node runs in its backward; a final callback queued from a Function's
    backward runs after it, in the same graph task, and can run a nested backward that fires another node's hook
    with no gradient, leaving that leaf's .grad None (what ``_settle`` does)."""
    from ..probes import expect

    p, q = (torch.ones(2, dtype=torch.float32, requires_grad=True) for _ in range(2))
    events: list = []
    p_node, q_node = get_gradient_edge(p).node, get_gradient_edge(q).node
    handles = [p_node.register_hook(lambda gi, go: events.append("p")),
               q_node.register_hook(lambda gi, go: events.append("q"))]

    def settle(will_run, task):
        events.append(("callback", will_run, task == torch._C._current_graph_task_id() != -1))
        with torch.enable_grad():
            out = _FireHooks.apply(False, q)
        out.backward()  # no explicit gradient: that path imports sympy (0.5 s at apply())

    try:
        (_ProbeStart.apply(settle, p_node, p * 2)).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    expect(events == ["p", ("callback", True, True), "q"],
           f"hooks and final callback ran as {events}, expected p's hook, the callback in that task, q's hook")
    expect(q.grad is None and torch.equal(p.grad, torch.full((2,), 2.0, dtype=torch.float32)),
           "a hook fired with no gradient wrote one")


ASSUMPTIONS = (
    probes.Assumption("ddp-attributes", "DistributedDataParallel keeps find_unused_parameters, static_graph, "
                      "require_backward_grad_sync, parameters_to_ignore, process_group, reducer and "
                      "_active_ddp_module as attributes", _check_ddp_attributes),
    *join.ASSUMPTIONS,
    probes.Assumption("autograd-hooks", "AccumulateGrad post-hooks, torch._C._current_graph_task_id, "
                      "torch._C._will_engine_execute_node and final callbacks queued from a backward run as "
                      "NOTE [Unused parameters without find_unused_parameters] describes", _check_autograd_hooks),
)
NO_SYNC_ASSUMPTIONS = (
    probes.Assumption("static-graph-flag", "DDP records its first static-graph delayed all-reduce in "
                      "_static_graph_delay_allreduce_enqueued (NOTE [static graph first step])",
                      _check_static_graph_flag),
)


def install() -> list[str]:
    if not probes.verify("reducer", ASSUMPTIONS, "DDP runs as without the library (no unused-parameter rescue, no "
                         "trainable-set check, no static-graph first sync)"):
        return []
    targets = built.install(rescue=True)
    trainable_set.watch_registrations()
    targets += [*join.patch_join_hook(), *join.patch_finalize_backward()]
    if probes.verify("no_sync", NO_SYNC_ASSUMPTIONS, "static_graph=True with gradient accumulation may hit "
                     "'expect_autograd_hooks_ INTERNAL ASSERT FAILED' as without the library"):
        _patch_ddp_no_sync()
        targets.append(TARGETS[1])
    return targets + teardown.install()

