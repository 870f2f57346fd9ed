"""The CheckpointFunction swap: inert in one process (also a world-size-1 group), non-reentrant under DDP."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ddp_patches
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
    with ddp_patches.patched() if patched else contextlib.nullcontext():
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
    with ddp_patches.patched() if patched else contextlib.nullcontext():
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


def test_bit_identical_under_torchrun_with_one_process(single_rank_pool):
    assert single_rank_pool.run(world_size_one_case) == [True]
