"""Unused parameters get one zero-gradient edge (ddp_patches/reach.py); DDP's own settings are never changed."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

import ddp_patches
from ddp_patches.reach import _ZeroGradEdges


def test_edges_alias_outputs_and_fire_the_hook_once_without_a_gradient():
    used, unused = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    fired = []
    node = get_gradient_edge(unused).node  # a leaf holds its AccumulateGrad node weakly; DDP keeps its own
    node.register_hook(lambda grad_in, grad_out: fired.append(grad_in))
    y = used * 2
    (out,) = _ZeroGradEdges.apply(1, False, y, unused)
    assert out.data_ptr() == y.data_ptr() and not out._is_view()  # an alias, not a copy or a view
    out.mul_(3)  # in-place on an output still works (TRL divides logits by the temperature in place)
    out.sum().backward()
    assert torch.equal(used.grad, torch.full((3,), 6.0))
    assert len(fired) == 1 and unused.grad is None  # the hook ran; .grad was left alone


def test_static_graph_edges_carry_a_defined_zero():
    p = torch.nn.Parameter(torch.randn(2))
    (out,) = _ZeroGradEdges.apply(1, True, torch.ones(2, requires_grad=True), p)
    out.sum().backward()
    assert torch.equal(p.grad, torch.zeros(2))


def ddp_settings(ddp_kwargs: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches import reach

    with ddp_patches.patched():
        ddp = DDP(torch.nn.Linear(4, 4), **ddp_kwargs)
    return {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
            "edges": reach.for_ddp(ddp) is not None}


@pytest.mark.parametrize("ddp_kwargs,expected", [
    ({}, {"find_unused_parameters": False, "static_graph": False, "edges": True}),
    ({"find_unused_parameters": False}, {"find_unused_parameters": False, "static_graph": False, "edges": True}),
    ({"find_unused_parameters": True}, {"find_unused_parameters": True, "static_graph": False, "edges": False}),
    ({"static_graph": True}, {"find_unused_parameters": False, "static_graph": True, "edges": True}),
])
def test_ddp_settings_are_passed_through_untouched(pool, ddp_kwargs, expected):
    for r in pool.run(ddp_settings, ddp_kwargs=ddp_kwargs):
        assert r == expected


def buckets_and_edges(module: str) -> dict:
    """Three iterations with DDP defaults: were buckets rebuilt, how many parameters got an edge each time."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches import reach
    from ddp_patches.verify.raw_models import RAW_MODULES, raw_batch, raw_loss

    torch.manual_seed(0)
    with ddp_patches.patched():
        ddp = DDP(RAW_MODULES[module](False).double())
        attached = []
        for it in range(3):
            raw_loss(ddp, raw_batch(torch.distributed.get_rank(), it, 0)).backward()
            attached.append(reach.for_ddp(ddp).attached_last)
        data = ddp._get_ddp_logging_data()
    return {"rebuilt": data.get("has_rebuilt_buckets"), "attached": attached}


def test_defaults_keep_bucket_rebuild_and_attach_only_unused(pool):
    """The forced find_unused of the last release stopped DDP from rebuilding its buckets; the edges do not."""
    ranks = pool.run(buckets_and_edges, module="unused_on_some_ranks")
    assert all(r["rebuilt"] == 1 for r in ranks)
    assert ranks[0]["attached"] == [0, 0, 0]  # rank 0 has images: its vision branch runs
    assert ranks[1]["attached"] == [2, 2, 2]  # text-only rank: vision weight and bias get an edge
    assert pool.run(buckets_and_edges, module="once")[0]["attached"] == [0, 0, 0]


def powersgd_case(patched: bool, iters: int = 30) -> list[float]:
    """DDP with PyTorch's PowerSGD hook; the parameters after ``iters`` steps (the forced find_unused hung here)."""
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with ddp_patches.patched() if patched else contextlib.nullcontext():
        ddp = DDP(model)
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(iters):
            ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [float(p.detach().sum()) for p in model.parameters()]


def test_powersgd_hook_trains_exactly_as_without_the_library(pool):
    unpatched = pool.run(powersgd_case, patched=False)
    patched = pool.run(powersgd_case, patched=True, timeout=120)
    assert patched == unpatched and patched[0] == patched[1]


def accelerate_style_sync(patched: bool) -> bool:
    """accelerate's test_distributed_sync_multiple_fwd: forwards under no_sync, the last backward synced through
    ``prepare_for_backward([])`` (what ``trigger_sync_in_backward`` does). The forced find_unused broke it."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    with ddp_patches.patched() if patched else contextlib.nullcontext():
        ddp = DDP(torch.nn.Linear(3, 1))
        losses = []
        for i in range(3):
            with ddp.no_sync():
                losses.append(ddp(torch.full((2, 3), float(rank + i))).pow(2).mean())
        losses[0].backward()
        losses[1].backward()
        ddp.require_backward_grad_sync = True
        ddp.reducer.prepare_for_backward([])
        losses[2].backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(2)]
    torch.distributed.all_gather(gathered, grads)
    return torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("patched", [False, True])
def test_trigger_sync_in_backward_pattern(pool, patched):
    assert pool.run(accelerate_style_sync, patched=patched) == [True, True]


def ran_but_unused_case(static_graph: bool, accum: int, patched: bool) -> dict:
    import contextlib

    from ddp_patches.verify.raw_models import raw_parity

    with ddp_patches.patched() if patched else contextlib.nullcontext():
        return raw_parity("ran_but_unused", use_reentrant=True, ddp_kwargs={"static_graph": static_graph},
                          accum=accum).as_dict()


@pytest.mark.parametrize("static_graph,accum", [(False, 1), (False, 2), (True, 2)])
def test_a_layer_that_runs_and_feeds_nothing_trains_with_ddp_defaults(pool, static_graph, accum):
    for r in pool.run(ran_but_unused_case, static_graph=static_graph, accum=accum, patched=True):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]


def test_a_layer_that_runs_and_feeds_nothing_fails_unpatched(pool):
    from tests.harness import RankError

    with pytest.raises(RankError, match="finished reduction in the prior iteration"):
        pool.run(ran_but_unused_case, static_graph=False, accum=1, patched=False)
