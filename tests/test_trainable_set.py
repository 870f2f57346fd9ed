"""The trainable-set check (ddp_patches/rescue/trainable_set.py, NOTE [A frozen parameter is judged at the backward]).

Two patterns that train without the library must train with it. Each runs here without and with
the library under real 2-rank DDP (gloo, each rank its own data) against a single process on the global batch;
the errors the check keeps are the ones where DDP without the library fails or drifts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ddp_patches
from tests._helpers import LibraryLog, library

W = 8


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(W, W)
        self.fc2 = torch.nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _lora(frozen_before_wrapping: str = "") -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_Tiny(), LoraConfig(r=2, target_modules=["fc1", "fc2"], init_lora_weights=False))
    for name, p in model.named_parameters():
        if frozen_before_wrapping and frozen_before_wrapping in name:
            p.requires_grad_(False)
    return model.double()


def _batch(rank: int, it: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * it + micro)
    return torch.randn(4, W, generator=g, dtype=torch.float64)


@contextlib.contextmanager
def _library(patched: bool):
    with LibraryLog() as warnings, library(patched):
        yield warnings


# -- 1. a reference forward through the same DDP inside peft's disable_adapter() --------------------------------
# peft's BaseTunerLayer.enable_adapters(False) sets requires_grad=False on every adapter weight, so the check saw
# a trainable set without the adapters. The reference output is detached (DPO/KTO written by hand, no separate
# reference model): no backward runs through that forward, and without the library it trains.
def _reference_loss(order: str):
    def loss_fn(model, x):
        peft_model = getattr(model, "module", model)  # the DDP, or the single-process replica

        def reference():
            with peft_model.disable_adapter():
                return model(x).detach()

        ref = reference() if order == "reference_first" else None
        policy = model(x)
        ref = reference() if ref is None else ref
        return (policy - ref).pow(2).mean() + policy.mean()

    return loss_fn


def reference_forward_case(patched: bool, order: str, ddp_kwargs: dict) -> dict:
    from ddp_patches.verify.parity import run_parity

    with _library(patched) as warnings:
        result = run_parity(_lora, _batch, torch.cat, _reference_loss(order), ddp_kwargs=ddp_kwargs, iters=3)
    return {**result.as_dict(), "warnings": warnings.messages}


@pytest.mark.parametrize("order,ddp_kwargs", [
    ("reference_first", {"find_unused_parameters": True}),
    ("policy_first", {}),
    ("policy_first", {"static_graph": True}),
    ("reference_first", {}),
    ("reference_first", {"static_graph": True}),
])
def test_reference_forward_under_disable_adapter_trains(pool, order, ddp_kwargs):
    for patched in (False, True):
        for r in pool.run(reference_forward_case, patched=patched, order=order, ddp_kwargs=ddp_kwargs):
            assert r["iterations"] == 3 and r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], (patched, r)
            assert r["warnings"] == [], r["warnings"]  # no false alarm


# -- 2. progressive freezing with find_unused_parameters=True (HF Trainer's default without checkpointing) --------
def _frozen_layer_training(ddp_kwargs: dict, iters: int = 5, freeze_at: int = 2) -> dict:
    """AdamW with weight decay; ``module[0]`` frozen from step ``freeze_at`` on, in the DDP and in a single-process
    replica on the global batch; the largest relative gradient difference over all steps, final parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.verify.parity import params_equal_across_ranks, relative_error

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Tanh(), torch.nn.Linear(W, W)).double()

    model, reference = build(), build()
    ddp = DDP(model, **ddp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    worst = 0.0
    for it in range(iters):
        if it == freeze_at:
            ddp.module[0].requires_grad_(False)
            reference[0].requires_grad_(False)
        ddp(_batch(rank, it)).pow(2).mean().backward()
        reference(torch.cat([_batch(r, it) for r in range(world)])).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None)
            worst = max(worst, relative_error(p.grad, q.grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return {"max_rel_error": worst, "param_drift": drift, "ranks_in_sync": params_equal_across_ranks(model)}


def progressive_freezing_case(patched: bool) -> dict:
    with _library(patched) as warnings:
        result = _frozen_layer_training({"find_unused_parameters": True})
    return {**result, "warnings": warnings.messages}


def test_progressive_freezing_with_find_unused_trains(pool):
    for patched in (False, True):
        for r in pool.run(progressive_freezing_case, patched=patched):
            assert r["max_rel_error"] <= 1e-9 and r["param_drift"] <= 1e-9 and r["ranks_in_sync"], (patched, r)
            assert r["warnings"] == [], r["warnings"]


# -- 3. what stays an error ----------------------------------------------------------------------------------
def freezing_with_a_waiting_reducer_case(patched: bool, ddp_kwargs: dict) -> dict:
    """find_unused_parameters=False or static_graph: the reducer waits for the frozen layer. Which step fails, how."""
    try:
        with _library(patched):
            _frozen_layer_training(ddp_kwargs)
    except RuntimeError as e:
        import traceback

        where = "backward" if any(f.name == "backward" for f in traceback.extract_tb(e.__traceback__)) else "forward"
        return {"error": type(e).__name__, "message": str(e), "where": where}
    return {"error": None}


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}])
def test_freezing_with_a_reducer_that_waits_is_a_clear_error_at_the_backward(pool, ddp_kwargs):
    for r in pool.run(freezing_with_a_waiting_reducer_case, patched=False, ddp_kwargs=ddp_kwargs):
        assert r["error"] == "RuntimeError" and "finished reduction in the prior iteration" in r["message"], r
    for r in pool.run(freezing_with_a_waiting_reducer_case, patched=True, ddp_kwargs=ddp_kwargs):
        assert r["error"] == "TrainableParametersChangedError" and r["where"] == "backward", r
        assert "changed after the model was wrapped" in r["message"] and "'0.weight'" in r["message"], r["message"]
        assert "find_unused_parameters=True" in r["message"], r["message"]


def adapter_unfrozen_by_peft_case(patched: bool) -> dict:
    """lora_A frozen before wrapping; leaving disable_adapter() sets requires_grad=True on every active adapter
    weight again (peft's set_adapter), so lora_A trains without DDP ever averaging it. find_unused_parameters=True:
    the reducer copes with the frozen adapters of the reference forward, so only the unfreezing is left."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.verify.parity import params_equal_across_ranks

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = _lora(frozen_before_wrapping="lora_A")
    try:
        with _library(patched):
            ddp = DDP(model, find_unused_parameters=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for it in range(3):
                _reference_loss("reference_first")(ddp, _batch(rank, it)).backward()
                opt.step()
                opt.zero_grad()
    except ddp_patches.TrainableParametersChangedError as e:
        return {"error": str(e)}
    return {"error": None, "ranks_in_sync": params_equal_across_ranks(model)}


def test_an_adapter_unfrozen_after_wrapping_stays_an_error(pool):
    unpatched = pool.run(adapter_unfrozen_by_peft_case, patched=False)
    assert unpatched[0] == {"error": None, "ranks_in_sync": False}  # silent drift without the library
    for r in pool.run(adapter_unfrozen_by_peft_case, patched=True):
        assert r["error"] and "now trainable, but not when DDP was built" in r["error"], r
        assert "lora_A" in r["error"], r["error"]


def test_a_listed_module_registered_into_a_new_container_does_not_force_a_walk():
    """Llama's forward slices ``self.layers[:n]``, a new ModuleList of the listed layers, every forward: before, each
    counted as a registration and ``named_parameters()`` was walked again at every forward. A module not listed yet
    (an adapter added after wrapping) still counts."""
    from ddp_patches.rescue import trainable_set

    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    trainable_set._listed.update(layers.modules())
    before = trainable_set._registrations[0]
    for name, layer in enumerate(layers[:2]._modules.values()):
        trainable_set._module_registered(torch.nn.ModuleList(), str(name), layer)
    assert trainable_set._registrations[0] == before
    trainable_set._module_registered(layers[0], "lora_A", torch.nn.Linear(2, 1))
    assert trainable_set._registrations[0] == before + 1
