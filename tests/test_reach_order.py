"""The unused-parameter rescue keeps DDP's collective order (NOTE [Unused parameters marked where DDP marks them]
in ddp_patches/rescue/graph.py).

Each pattern: 2 gloo ranks with different data, a parameter only rank 0 uses, ``find_unused_parameters=False``,
gradients compared every iteration with a single process on the global batch, and another collective on the same
process group inside the backward: a second DDP (an ensemble ``f(A(x)) + g(B(x))``, a GAN generator step
``D(G(z))``) or a differentiable all-reduce inside the model (a SyncBatchNorm-like statistic). Without the library
each fails: the two-DDP patterns hang or raise DDP's "Expected to have finished reduction" on the next forward,
the in-model all-reduce raises that error; when the rescue fired unused hooks at the end of the backward instead,
the bucket holding the unused parameter was all-reduced after the other collective on one rank and before it on
the other: wrong gradients (relative error 0.09-0.36) with equal bucket sizes, gloo's collective mismatch with
unequal ones.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ddp_patches
from ddp_patches.verify.raw_models import _HiddenReentrant

W = 8


def _batch(width: int):
    """Rows of ``width`` features and a last column flagging rank 0's rows (the branch runs only there)."""

    def make(rank, it, micro, rows=4):
        g = torch.Generator().manual_seed(10_000 * rank + 100 * it + micro)
        x = torch.randn(rows, width, generator=g, dtype=torch.float64)
        return torch.cat([x, torch.full((rows, 1), float(rank == 0), dtype=torch.float64)], dim=1)

    return make


class _Branchy(nn.Module):
    """A trunk and a branch that runs only on flagged rows (a vision tower on a text-only rank)."""

    def __init__(self, width: int):
        super().__init__()
        self.trunk = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)

    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        out = self.trunk(x)
        if bool(flag.any()):
            out = out + self.branch(x) * flag
        return out


class _Ensemble(nn.Module):
    """``f(A(x)) + g(B(x))``: A has the branch; B is a plain MLP of width ``b_width``."""

    def __init__(self, b_width: int):
        super().__init__()
        self.a = _Branchy(W)
        self.b = nn.Sequential(nn.Linear(W, b_width), nn.Tanh(), nn.Linear(b_width, W))

    def forward(self, x):
        g = self.b(x[:, :-1]).sin()  # B first, so that autograd runs A's backward (the newer nodes) before B's
        return self.a(x).tanh() + g


class _Gan(nn.Module):
    """A generator step: ``D(G(z))``; the discriminator has the branch, the generator is of width ``g_width``."""

    def __init__(self, g_width: int):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(W, g_width), nn.Tanh(), nn.Linear(g_width, W))
        self.d = _Branchy(W)

    def forward(self, x):
        flag, z = x[:, -1:], x[:, :-1]
        return self.d(torch.cat([self.g(z), flag], dim=1))


def _two_ddps(first: str, second: str):
    def wrap(model, **kwargs):
        from torch.nn.parallel import DistributedDataParallel as DDP

        for name in (first, second):  # each its own DDP, both on the default group; one bucket per parameter
            setattr(model, name, DDP(getattr(model, name), bucket_cap_mb=1e-6, **kwargs))
        return model

    return wrap


def _mse(model, x):
    return model(x).pow(2).mean()


def _parity(build, make_batch, wrap, patched: bool, iters: int = 4) -> dict:
    from ddp_patches.verify.parity import run_parity

    with ddp_patches.patched() if patched else contextlib.nullcontext():
        return run_parity(lambda: build().double(), make_batch, torch.cat, _mse, wrap=wrap, iters=iters).as_dict()


def ensemble_case(b_width: int, patched: bool = True) -> dict:
    return _parity(lambda: _Ensemble(b_width), _batch(W), _two_ddps("a", "b"), patched)


def gan_case(g_width: int, patched: bool = True) -> dict:
    return _parity(lambda: _Gan(g_width), _batch(W), _two_ddps("g", "d"), patched)


class _AllReducedStatistic(nn.Module):
    """A SyncBatchNorm-like layer: the batch mean of ``lin(x)`` over every rank through a differentiable
    all-reduce (``torch.distributed.nn.functional.all_reduce``); the reference (one process, the global batch)
    takes the same mean locally. Then a branch only flagged rows take."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.branch = nn.Linear(W, W)
        self.head = nn.Linear(W, W)
        self.synced = False

    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        h = self.lin(x)
        total, count = h.sum(0), torch.tensor(float(h.shape[0]), dtype=h.dtype)
        if self.synced:
            from torch.distributed.nn.functional import all_reduce

            total = all_reduce(total)
            count = count * torch.distributed.get_world_size()
        h = h - 0.5 * total / count  # half the mean: a full centring would cancel lin.bias (gradient 0)
        if bool(flag.any()):
            h = h + self.branch(h) * flag
        return self.head(h.tanh())


def in_model_all_reduce_case(patched: bool = True) -> dict:
    def wrap(model, **kwargs):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.synced = True
        return DDP(model, bucket_cap_mb=1e-6, **kwargs)

    return _parity(_AllReducedStatistic, _batch(W), wrap, patched)


@pytest.mark.parametrize("width", [W, 2 * W], ids=["equal-buckets", "unequal-buckets"])
@pytest.mark.parametrize("case", ["ensemble_case", "gan_case"])
def test_two_ddps_on_one_group_train_exactly(pool, case, width):
    for r in pool.run(globals()[case], **({"b_width": width} if case == "ensemble_case" else {"g_width": width})):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], r


def test_an_all_reduce_inside_the_model_keeps_its_place(pool):
    for r in pool.run(in_model_all_reduce_case):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], r


def test_an_all_reduce_inside_the_model_fails_unpatched(pool):
    """The unpatched outcome: DDP's own error at the second forward (the branch's hook never fired on rank 1)."""
    from tests.harness import RankError

    with pytest.raises(RankError, match="finished reduction in the prior iteration"):
        pool.run(in_model_all_reduce_case, patched=False, timeout=120)


class _ReentrantHead(_AllReducedStatistic):
    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        h = self.lin(x)
        if bool(flag.any()):
            h = h + self.branch(h) * flag
        total = h.sum(0)
        if self.synced:
            from torch.distributed.nn.functional import all_reduce

            total = all_reduce(total)
        # A home-made reentrant region: the outer graph cannot tell which parameters its nested backward reaches.
        return _HiddenReentrant.apply(self.head, (h - 0.01 * total).tanh())


def late_fire_among_collectives_case(patched: bool = True) -> dict:
    def wrap(model, **kwargs):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.synced = True
        return DDP(model, bucket_cap_mb=1e-6, **kwargs)

    return _parity(_ReentrantHead, _batch(W), wrap, patched, iters=2)


@pytest.mark.slow
def test_a_late_fire_among_collectives_fails_loudly(pool):
    """Where a reentrant Function in the graph keeps the unused branch's hook for the end of the backward and the
    model all-reduces in its backward, the rank without the branch raises, naming the fixes, instead of pairing
    buffers wrongly. Without the library: DDP's "finished reduction" error at the next forward."""
    from tests.harness import RankError

    with pytest.raises(RankError, match=r"(?s)rank 1.*got no gradient on this rank.*collective in this backward.*"
                                        r"new_group"):
        pool.run(late_fire_among_collectives_case, timeout=120)
    with pytest.raises(RankError, match="finished reduction in the prior iteration"):
        pool.run(late_fire_among_collectives_case, patched=False, timeout=120)


class _StraightThrough(torch.autograd.Function):
    """A straight-through estimator: round in forward, identity in backward (no nested backward, but not on the
    library's list of Functions known to run none)."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _NeverUsed(_AllReducedStatistic):
    """The all-reduced statistic, a straight-through estimator, and a layer no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.never = nn.Linear(W, W)

    def forward(self, x):
        flag, x = x[:, -1:], x[:, :-1]
        h = self.lin(x)
        total = h.sum(0)
        if self.synced:
            from torch.distributed.nn.functional import all_reduce

            total = all_reduce(total)
        h = h - 0.01 * total + 0.1 * _StraightThrough.apply(h * 4) / 4
        return self.head(h.tanh())


def never_used_static_case(patched: bool = True) -> dict:
    def wrap(model, **kwargs):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.synced = True
        return DDP(model, bucket_cap_mb=1e-6, static_graph=True, **kwargs)

    return _parity(_NeverUsed, _batch(W), wrap, patched, iters=3)


@pytest.mark.parametrize("patched", [False, True])
def test_a_late_fire_on_every_rank_trains(pool, patched):
    """static_graph, a layer no rank uses, an unknown custom Function (so the late path) and an all-reduce in the
    model: every rank fires the layer at the end, in the same place, so nothing is refused (found by review: the
    first version raised where DDP trains exactly)."""
    for r in pool.run(never_used_static_case, patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], r


class _DualEncoder(nn.Module):
    """Two forwards of one DDP in one loss: the document tower inside a home-made reentrant region, then the
    query tower plainly (found by review: the walk looked only below the first forward's outputs)."""

    def __init__(self):
        super().__init__()
        self.emb, self.q, self.d = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x, doc: bool):
        h = self.emb(x).tanh()
        return _HiddenReentrant.apply(self.d, h) if doc else self.q(h)


def _dual_loss(model, x):
    x = x[:, :-1]
    d = model(x.flip(1), doc=True)  # the document first: the query's start node runs first in the backward
    q = model(x, doc=False)
    return ((q * d).sum(1) - 1).pow(2).mean()


def dual_encoder_case(patched: bool = True) -> dict:
    from ddp_patches.verify.parity import run_parity

    with ddp_patches.patched() if patched else contextlib.nullcontext():
        return run_parity(lambda: _DualEncoder().double(), _batch(W), torch.cat, _dual_loss, iters=3).as_dict()


@pytest.mark.parametrize("patched", [False, True])
def test_two_forwards_with_a_reentrant_region_train(pool, patched):
    for r in pool.run(dual_encoder_case, patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], r


def watch_installed_case() -> dict:
    """Per rank: whether the custom-Function watch is on after apply(), after a DDP is built, and after revert()."""
    from torch.autograd.function import BackwardCFunction
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_patches.apply()
    try:
        after_apply = "__init__" in vars(BackwardCFunction)
        DDP(nn.Linear(W, 1))
        after_ddp = "__init__" in vars(BackwardCFunction)
    finally:
        ddp_patches.revert()
    return {"apply": after_apply, "ddp": after_ddp, "revert": "__init__" in vars(BackwardCFunction)}


def test_the_custom_function_watch_starts_with_the_first_ddp(pool):
    """NOTE [No walk without a custom Function]: apply() alone touches none of torch's autograd classes (in one
    process nothing changes); the first DDP built under it starts the watch, and revert() removes it."""
    from torch.autograd.function import BackwardCFunction

    ddp_patches.apply()
    try:
        assert "__init__" not in vars(BackwardCFunction)
    finally:
        ddp_patches.revert()
    for r in pool.run(watch_installed_case):
        assert r == {"apply": False, "ddp": True, "revert": False}


def test_a_full_backward_hook_is_known_to_run_no_nested_backward():
    """``register_full_backward_hook`` puts a BackwardHookFunction node in the graph; torch 2.13 moved it to
    torch.nn.modules._functions, and under the old name alone the walk took it for a Function that may run a nested
    backward: unreachable parameters then waited for the end of the backward instead of firing where DDP's own
    find_unused_parameters=True marks them (NOTE [Unused parameters marked where DDP marks them])."""
    from ddp_patches.rescue.graph import walk_graph

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    out = model(torch.randn(2, 4, requires_grad=True)).sum()
    facts = walk_graph([out.grad_fn])
    assert facts.may_nest is None and facts.collectives == [], facts
