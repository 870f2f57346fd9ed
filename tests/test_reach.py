"""Unused parameters get one zero-gradient edge (ddp_patches/rescue/edges.py); DDP's own settings are never changed."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

import ddp_patches
from ddp_patches.rescue.edges import _BackwardStart, _FireHooks


def test_outputs_are_aliases_and_a_fired_hook_leaves_grad_alone():
    used, unused = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    fired = []
    node = get_gradient_edge(unused).node  # a leaf holds its AccumulateGrad node weakly; DDP keeps its own
    node.register_hook(lambda grad_in, grad_out: fired.append(grad_in))

    class Settles:
        def backward_started(self, ddp, node=None):
            with torch.enable_grad():
                out = _FireHooks.apply(False, unused)
            torch.autograd.backward(out, torch.zeros_like(out))

    y = used * 2
    out = _BackwardStart.apply(Settles(), None, y)
    assert out.data_ptr() == y.data_ptr() and not out._is_view()  # an alias, not a copy or a view
    out.mul_(3)  # in-place on an output still works (TRL divides logits by the temperature in place)
    out.sum().backward()
    assert torch.equal(used.grad, torch.full((3,), 6.0))
    assert len(fired) == 1 and unused.grad is None  # the hook ran; .grad was left alone


def test_static_graph_fire_carries_a_defined_zero():
    p = torch.nn.Parameter(torch.randn(2))
    out = _FireHooks.apply(True, p)
    torch.autograd.backward(out, torch.zeros_like(out))
    assert torch.equal(p.grad, torch.zeros(2))


def test_tensors_are_found_as_ddp_finds_them():
    from ddp_patches.rescue.outputs import map_tensors

    @__import__("dataclasses").dataclass(frozen=True)
    class Inner:
        t: torch.Tensor

    leaf = torch.nn.Parameter(torch.ones(1))
    a, b = leaf * 2, leaf * 3
    out = map_tensors({"x": [a, leaf], "y": Inner(b)}, lambda t: isinstance(t, torch.Tensor) and t.grad_fn is not None,
                      lambda ts: tuple(t + 1 for t in ts))
    assert out["x"][1] is leaf and torch.equal(out["x"][0], a + 1) and torch.equal(out["y"].t, b + 1)


def ddp_settings(ddp_kwargs: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.rescue import edges as rescue

    with ddp_patches.patched():
        ddp = DDP(torch.nn.Linear(4, 4), **ddp_kwargs)
    return {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
            "edges": rescue.needed(ddp)}


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

    from ddp_patches.rescue import edges as rescue
    from ddp_patches.verify.raw_models import RAW_MODULES, raw_batch, raw_loss

    torch.manual_seed(0)
    with ddp_patches.patched():
        ddp = DDP(RAW_MODULES[module](False).double())
        attached = []
        for it in range(3):
            raw_loss(ddp, raw_batch(torch.distributed.get_rank(), it, 0)).backward()
            attached.append(rescue.for_ddp(ddp).attached_last)
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


# -- patterns that train without the library must train with it ------------------------------------
# Each rank function returns the parity result (gradients every iteration against a single process on the global
# batch, parameters bit-identical across ranks at the end).
W = 8


def _flag_batch(flag):
    """A batch builder whose last column is ``flag(rank, it)`` (1.0: this row takes the optional branch)."""

    def make(rank, it, micro, rows=4):
        g = torch.Generator().manual_seed(10_000 * rank + 100 * it + micro)
        x = torch.randn(rows, W, generator=g, dtype=torch.float64)
        return torch.cat([x, torch.full((rows, 1), float(flag(rank, it)), dtype=torch.float64)], dim=1)

    return make


class _Branchy(torch.nn.Module):
    """A trunk and a branch (a vision tower) that runs only on rows flagged 1.0, under no_grad if asked."""

    def __init__(self, branch_no_grad=False):
        super().__init__()
        self.trunk = torch.nn.Linear(W, W)
        self.branch = torch.nn.Linear(W, W)
        self.branch_no_grad = branch_no_grad

    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        out = self.trunk(x)
        if bool(flag.any()):
            if self.branch_no_grad:
                with torch.no_grad():
                    feats = self.branch(x)
            else:
                feats = self.branch(x)
            out = out + feats * flag
        return out


def _mse(model, x):
    return model(x).pow(2).mean()


def _parity(build, make_batch, loss_fn=_mse, patched=True, ddp_kwargs=None, wrap=None, iters=4, accum=1):
    import contextlib

    from ddp_patches.verify.parity import run_parity

    extra = {"wrap": wrap} if wrap is not None else {}
    with ddp_patches.patched() if patched else contextlib.nullcontext():
        return run_parity(lambda: build().double(), make_batch, torch.cat, loss_fn, ddp_kwargs=ddp_kwargs or {},
                          iters=iters, accum=accum, **extra).as_dict()


def _static_after_construction(module, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, **kwargs)
    ddp._set_static_graph()  # "to allow checkpointing", after construction
    return ddp


def static_set_late_case(patched: bool) -> dict:
    """No rank uses the branch in step 0, then only rank 0 does; static graph set after construction."""
    return _parity(_Branchy, _flag_batch(lambda r, it: r == 0 and it >= 1), patched=patched,
                   wrap=_static_after_construction)


def test_static_graph_set_after_construction_is_correct(pool):
    for r in pool.run(static_set_late_case, patched=True):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]


class _HiddenStates(torch.nn.Module):
    """Returns hidden states; the loss applies ``head`` itself (the chunked-loss pattern)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(W, W)
        self.head = torch.nn.Linear(W, W)

    def forward(self, x):
        return self.body(x[:, :-1]).tanh()


def _head_in_reentrant_checkpoint(model, x):
    from torch.utils.checkpoint import checkpoint

    head = getattr(model, "module", model).head
    return checkpoint(head, model(x), use_reentrant=True).pow(2).mean()


def reentrant_loss_outside_forward_case(patched: bool) -> dict:
    """A reentrant checkpoint outside the DDP forward uses DDP's parameters."""
    return _parity(_HiddenStates, _flag_batch(lambda r, it: 0), loss_fn=_head_in_reentrant_checkpoint,
                   patched=patched)


class _LinearByWeight(torch.autograd.Function):
    """A home-made reentrant region that uses a parameter directly (``F.linear(t, head.weight)``), not through
    its module: forward under no_grad, recompute and ``torch.autograd.backward`` in backward."""

    @staticmethod
    def forward(ctx, head, x):
        ctx.head = head
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.nn.functional.linear(x, head.weight, head.bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = torch.nn.functional.linear(x, ctx.head.weight, ctx.head.bias)
        torch.autograd.backward(out, grad)
        return None, x.grad


class _ParameterUsedDirectly(_HiddenStates):
    def forward(self, x):
        return _LinearByWeight.apply(self.head, self.body(x[:, :-1]).tanh())


def parameter_used_directly_case(patched: bool) -> dict:
    """A reentrant Function inside the forward uses ``self.head.weight`` directly."""
    return _parity(_ParameterUsedDirectly, _flag_batch(lambda r, it: 0), patched=patched)


@pytest.mark.parametrize("case", ["reentrant_loss_outside_forward_case", "parameter_used_directly_case"])
@pytest.mark.parametrize("patched", [False, True])
def test_reentrant_regions_the_forward_cannot_see_train(pool, case, patched):
    for r in pool.run(globals()[case], patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]


def no_grad_tower_static_case(patched: bool) -> dict:
    """LLaVA-style ``with torch.no_grad(): feats = self.vision(img)``, skipped on text-only batches, which
    come on different steps on each rank; static_graph=True."""
    return _parity(lambda: _Branchy(branch_no_grad=True), _flag_batch(lambda r, it: (r + it) % 2 == 0),
                   patched=patched, ddp_kwargs={"static_graph": True})


@pytest.mark.parametrize("patched", [False, True])
def test_trainable_tower_under_no_grad_with_static_graph(pool, patched):
    for r in pool.run(no_grad_tower_static_case, patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]


@__import__("dataclasses").dataclass
class _Out:
    logits: torch.Tensor
    note: str = "plain dataclass"


class _DataclassOutput(_Branchy):
    def forward(self, x):
        return _Out(super().forward(x))


def _dataclass_mse(model, x):
    return model(x).logits.pow(2).mean()


def dataclass_output_case(patched: bool) -> dict:
    """The output is a plain @dataclass; rank 1 never uses the branch."""
    return _parity(_DataclassOutput, _flag_batch(lambda r, it: r == 0), loss_fn=_dataclass_mse, patched=patched)


def test_dataclass_outputs_are_rescued(pool):
    for r in pool.run(dataclass_output_case, patched=True):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]


def adamw_case(patched: bool, ddp_kwargs: dict, steps: int = 20) -> dict:
    """The branch is used (on every rank) in step 0 only; AdamW with weight decay for ``steps`` steps."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    make = _flag_batch(lambda r, it: it == 0)
    torch.manual_seed(0)
    model = _Branchy().double()
    with ddp_patches.patched() if patched else contextlib.nullcontext():
        ddp = DDP(model, **ddp_kwargs)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
        none_after = []
        for it in range(steps):
            _mse(ddp, make(rank, it, 0)).backward()
            none_after.append(model.branch.weight.grad is None)
            opt.step()
            opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "branch_grad_none": none_after}


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}])
def test_unused_everywhere_ends_with_grad_none_and_adamw_matches_find_unused(pool, ddp_kwargs):
    reference = pool.run(adamw_case, patched=False, ddp_kwargs={"find_unused_parameters": True})
    patched = pool.run(adamw_case, patched=True, ddp_kwargs=ddp_kwargs)
    for ref, got in zip(reference, patched):
        assert got["branch_grad_none"] == ref["branch_grad_none"] == [False] + [True] * 19
        for name, p in ref["params"].items():
            assert (got["params"][name] - p).abs().max().item() <= 1e-12, name


class _ReturnsItsScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(W, W)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.lin(x[:, :-1]) * self.scale, self.scale


def smaller_items_case() -> dict:
    """A parameter returned as an output stays itself; a module wrapped many times keeps one set of node hooks;
    apply() after a DDP exists says so."""
    import logging

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.rescue import edges as rescue

    torch.manual_seed(0)
    model = _ReturnsItsScale().double()
    early = DDP(torch.nn.Linear(2, 2))  # built before apply(): unprotected
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("ddp_patches").addHandler(handler)
    try:
        with ddp_patches.patched():
            for _ in range(31):
                ddp = DDP(model)
                out, scale = ddp(_flag_batch(lambda r, it: 0)(torch.distributed.get_rank(), 0, 0))
                (out.pow(2).mean() + scale).backward()
            hooks = sum(len(e._node_hooks) for e in list(rescue._instances.values()))
    finally:
        logging.getLogger("ddp_patches").removeHandler(handler)
    del early
    return {"scale_is_param": scale is model.scale, "node_hooks": hooks, "n_params": len(list(model.parameters())),
            "warned": any("built before apply()" in r for r in records)}


def test_smaller_items(pool):
    rank0, rank1 = pool.run(smaller_items_case)
    assert rank0["scale_is_param"] and rank1["scale_is_param"]
    assert rank0["node_hooks"] == rank0["n_params"]  # one set, not 31
    assert rank0["warned"] and not rank1["warned"]  # rank 0 says it


def _input_gradient_then_backward(model, x):
    """An ``autograd.grad`` through the DDP outputs (an input gradient: saliency, an adversarial step) before the
    loss's backward: it runs no AccumulateGrad node, so it must fire no DDP hook."""
    x = x.clone().requires_grad_(True)
    out = model(x).pow(2).mean()
    (gx,) = torch.autograd.grad(out, x, retain_graph=True)
    return out + 0.0 * gx.sum()


def autograd_grad_case(patched: bool) -> dict:
    return _parity(_Branchy, _flag_batch(lambda r, it: r == 0), loss_fn=_input_gradient_then_backward,
                   patched=patched, ddp_kwargs={"find_unused_parameters": True} if not patched else {})


@pytest.mark.parametrize("patched", [False, True])
def test_autograd_grad_through_the_outputs_fires_nothing(pool, patched):
    for r in pool.run(autograd_grad_case, patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"]
