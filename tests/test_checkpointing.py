"""The CheckpointFunction swap: inert in one process (also a world-size-1 group), non-reentrant under DDP."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ddp_patches
from tests._helpers import library, library_warnings
from tests.harness import DistPool, grad_fn_names


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=True)


def swap_case(patched: bool = True, under_ddp: bool = True) -> dict:
    """Reentrant checkpoint with dropout inside (in a DDP forward when distributed and ``under_ddp``): which path
    ran, and do its gradients match no checkpoint?"""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _Checkpointed().double()
    layer = model.layer
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with library(patched):
        run = DDP(model) if under_ddp and dist.is_initialized() else model
        state = torch.get_rng_state()
        out = run(x)
        out.sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.set_rng_state(state)
    layer(x).sum().backward()  # same dropout mask, no checkpoint
    if under_ddp and dist.is_initialized():  # DDP averaged the gradients of the ranks' own inputs: so does this
        for p in layer.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    return {
        "reentrant_node": "CheckpointFunctionBackward" in grad_fn_names(out),
        "grads_equal": all(torch.allclose(a, p.grad, rtol=0, atol=1e-12) for a, p in zip(grads, layer.parameters())),
    }


def test_single_process_keeps_reentrant_path():
    r = swap_case()
    assert r["reentrant_node"] and r["grads_equal"]


def test_ddp_runs_non_reentrant_with_rng_preserved(pool):
    for r in pool.run(swap_case):
        assert not r["reentrant_node"]  # the reentrant Function never ran
        assert r["grads_equal"]  # preserve_rng_state was passed on: the recompute replays the dropout mask


def test_distributed_but_outside_ddp_stays_reentrant(pool):
    """No DDP forward is running: nothing to fix, so the user's choice stands (NOTE [Engines])."""
    for r in pool.run(swap_case, under_ddp=False):
        assert r["reentrant_node"] and r["grads_equal"]


def lora_loss_and_grads(patched: bool) -> tuple:
    from ddp_patches.verify.hf_models import build_lora_model, lm_batch, lm_loss

    torch.manual_seed(0)
    with library(patched):
        model = build_lora_model("llama", {"use_reentrant": True})
        loss = lm_loss(model, lm_batch(0, 0, 0))
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def world_size_one_case() -> bool:
    import torch.distributed as dist

    assert dist.get_world_size() == 1 and not ddp_patches.is_distributed()
    (la, ga), (lb, gb) = lora_loss_and_grads(False), lora_loss_and_grads(True)
    return torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_bit_identical_without_process_group():
    (la, ga), (lb, gb) = lora_loss_and_grads(False), lora_loss_and_grads(True)
    assert torch.equal(la, lb)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


@pytest.fixture(scope="module")
def single_rank_pool():
    p = DistPool(world_size=1)
    yield p
    p.close()


@pytest.mark.slow
def test_bit_identical_under_torchrun_with_one_process(single_rank_pool):
    assert single_rank_pool.run(world_size_one_case) == [True]


# -- a tool's wrapper around torch.utils.checkpoint.checkpoint that forces use_reentrant (ms-swift's trainer) -----
class _SharedTwice(torch.nn.Module):
    """One Linear in two reentrant checkpoints: "marked as ready twice" under DDP unless the swap acts."""

    def __init__(self):
        super().__init__()
        self.first, self.shared, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        import torch.utils.checkpoint as torch_checkpoint

        x = self.first(x)  # the checkpoints' input requires grad: their parameters get gradients either way
        for _ in range(2):  # looked up at call time, as transformers' and the tools' code does
            x = torch_checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(x)


@contextlib.contextmanager
def _wrapping_checkpoint(kind: str, keeps_wrapped: bool = True):
    """The module attribute replaced by a tool's wrapper (``keeps_wrapped``: made with functools.wraps, as ms-swift
    does, so __wrapped__ leads to torch's function). ``kind``: "forces" ignores the caller's use_reentrant (ms-swift's
    ``_fix_gradient_checkpointing``); "forces-per-call" also wraps the function anew on each call; "counts" adds
    behaviour (a call counter) and passes every argument on."""
    import functools
    import torch.utils.checkpoint as torch_checkpoint

    old, calls = torch_checkpoint.checkpoint, []

    def wrapper(function, *args, use_reentrant=None, **kwargs):
        calls.append(use_reentrant)
        if kind == "counts":
            return old(function, *args, use_reentrant=use_reentrant, **kwargs)
        if kind == "forces-per-call":
            return old(lambda *a: function(*a), *args, use_reentrant=True, **kwargs)
        return old(function, *args, use_reentrant=True, **kwargs)

    torch_checkpoint.checkpoint = functools.wraps(old)(wrapper) if keeps_wrapped else wrapper
    try:
        yield calls
    finally:
        torch_checkpoint.checkpoint = old


class _Recursive(torch.nn.Module):
    """A block that checkpoints itself once more inside (depth 2): one Linear in nested reentrant checkpoints."""

    def __init__(self):
        super().__init__()
        self.first, self.shared, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def block(self, x, depth):
        x = torch.tanh(self.shared(x))
        if depth:
            x = checkpoint(self.block, x, depth - 1, use_reentrant=True)
        return x

    def forward(self, x):
        return self.head(checkpoint(self.block, self.first(x), 1, use_reentrant=True))


def wrapper_case(patched: bool, kind: str = "forces", keeps_wrapped: bool = True, before_apply: bool = False,
                 model: str = "shared") -> dict:
    from ddp_patches.verify.parity import run_parity

    wrapping = _wrapping_checkpoint(kind, keeps_wrapped) if kind else contextlib.nullcontext([])
    patches = library(patched)
    first, second = (wrapping, patches) if before_apply else (patches, wrapping)
    build = {"shared": _SharedTwice, "recursive": _Recursive}[model]
    with library_warnings() as lines:
        try:
            with first as a, second as b:
                calls = a if before_apply else b
                batch = lambda rank, it, micro: torch.randn(4, 8, dtype=torch.float64,  # noqa: E731
                                                            generator=torch.Generator().manual_seed(rank * 10 + it))
                result = run_parity(lambda: build().double(), batch, torch.cat,
                                    lambda m, x: m(x).pow(2).mean(), iters=2)
            return {"error": None, "max_rel_error": result.max_rel_error, "calls": list(calls), "log": lines}
        except RuntimeError as e:
            return {"error": str(e).splitlines()[0], "log": lines}


CAME_BACK = "came back as reentrant"


@pytest.mark.parametrize("kind", ["forces", "forces-per-call"])
@pytest.mark.parametrize("before_apply", [False, True], ids=["installed-after-apply", "installed-before-apply"])
def test_a_checkpoint_wrapper_that_forces_reentrant(pool, before_apply, kind):
    """NOTE [The swap calls torch's own checkpoint]: unpatched the wrapper's reentrant checkpoints fail under DDP;
    patched the call that comes back goes to torch's own function (through __wrapped__): parity, no recursion."""
    for r in pool.run(wrapper_case, patched=False, kind=kind, before_apply=before_apply):
        assert r["error"] is not None and "ready only once" in r["error"], r
    for r in pool.run(wrapper_case, patched=True, kind=kind, before_apply=before_apply):
        assert r["error"] is None and r["max_rel_error"] <= 1e-12, r
        assert not any(CAME_BACK in ln for ln in r["log"]), r["log"]


def test_a_checkpoint_wrapper_without_wrapped_makes_the_swap_step_aside_loudly(pool):
    """No __wrapped__ leads past it: the swap steps aside with one WARNING and the run fails as it does unpatched,
    instead of recursing."""
    results = pool.run(wrapper_case, patched=True, keeps_wrapped=False)
    for r in results:
        assert r["error"] is not None and "ready only once" in r["error"], r
    assert any(CAME_BACK in ln for ln in results[0]["log"]), results[0]["log"]


def test_a_wrapper_that_adds_behaviour_still_sees_the_swapped_call(pool):
    """A wrapper that passes use_reentrant on is called by the swap too (as before the guard): True from the
    caller, then False from the swap, for each of the two checkpoints and each forward."""
    for r in pool.run(wrapper_case, patched=True, kind="counts"):
        assert r["error"] is None and r["max_rel_error"] <= 1e-12, r
        assert r["calls"][:4] == [True, False, True, False], r["calls"]


def test_a_function_that_checkpoints_itself_swaps_at_every_depth(pool):
    """The nested call comes after the function started: it is the user's own checkpoint, swapped as usual."""
    for r in pool.run(wrapper_case, patched=False, kind="", model="recursive"):
        assert r["error"] is not None, r
    for r in pool.run(wrapper_case, patched=True, kind="", model="recursive"):
        assert r["error"] is None and r["max_rel_error"] <= 1e-12, r
        assert not any(CAME_BACK in ln for ln in r["log"]), r["log"]
