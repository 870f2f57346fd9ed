"""Offload acts on the composable ``checkpoint(module)`` that FSDP2 users apply per block, whichever was imported
first (NOTE [Modules that imported the generator by name] in ddp_patches/offload/offloader.py)."""

from __future__ import annotations

import sys

import torch
from torch import nn

import ddp_patches
from ddp_patches.offload import offloader as offload
from ddp_patches.verify.cpu_offload import cpu_path_offloader, forced

WIDTH = 16


class _Blocks(nn.Module):
    """An input projection, then blocks each checkpointed with the composable API, like a decoder."""

    def __init__(self, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return h


def _composable(model: _Blocks) -> _Blocks:
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)
    return model


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_composable_checkpoint_imported_before_apply_is_offloaded():
    import torch.distributed._composable.checkpoint_activation  # noqa: F401 - first, as transformers + peft do

    assert "torch.distributed._composable.checkpoint_activation" in sys.modules
    torch.manual_seed(0)
    model = _composable(_Blocks()).double()
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    expected = _grads(model, x)
    with ddp_patches.patched(offload=True) as report, offload.use_offloader(forced()) as off:
        got = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats is not None and off.stats.offloaded_tensors == 3, off.stats  # 4 block inputs: the last stays
    assert any("checkpoint_activation" in name for name in report.installed), report.installed
    module = sys.modules["torch.distributed._composable.checkpoint_activation"]
    assert all(not hasattr(getattr(module, n, None), "__ddp_patches__")  # revert() restored its copy too
               for n in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"))


def fsdp2_composable_case() -> dict:
    """2 ranks, each block fully_shard-ed and checkpointed with the composable API; offload (the CPU path, gated as
    by default: distributed, under FSDP2) against no offload: bit-identical gradients, and inputs moved."""
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        model = _composable(_Blocks()).double()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    rank = torch.distributed.get_rank()
    x = torch.randn(6, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))

    def full_grads(model):
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        return [p.grad.full_tensor().clone() for p in model.parameters()]

    with ddp_patches.patched():
        expected = full_grads(build())
    with ddp_patches.patched(offload=True), offload.use_offloader(cpu_path_offloader()) as off:
        got = full_grads(build())
    return {"equal": all(torch.equal(a, b) for a, b in zip(expected, got)),
            "offloaded": None if off.stats is None else off.stats.offloaded_tensors}


def test_fsdp2_composable_checkpoint_is_offloaded(pool):
    for r in pool.run(fsdp2_composable_case):
        assert r["equal"] and r["offloaded"] == 3, r
