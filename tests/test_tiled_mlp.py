"""Tiled MLP: gradient parity with the untiled model on 2 ranks fed different data (and different lengths),
each DDP hook firing once per step, dropout replay, every family's MLP class, QLoRA and full HF models."""

from __future__ import annotations

import logging

import math

import pytest
import torch

import ddp_patches
from ddp_patches import engines, tiled_mlp
from ddp_patches.verify import mlp_models
from tests._helpers import library

SHARD = 4  # tokens per shard: 2 rows x 7..12 tokens -> 4 to 6 shards, varying between ranks and steps


def stack_case(**kwargs) -> dict:
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        result = mlp_models.stack_parity(**kwargs).as_dict()
        result["counts"] = tiled_mlp.counts()
    return result


MODES = {
    "defaults": {},
    "find-unused": {"ddp_kwargs": {"find_unused_parameters": True}},
    "static": {"ddp_kwargs": {"static_graph": True}},
    "static-accum": {"ddp_kwargs": {"static_graph": True}, "accum": 2},
    "find-unused-accum-bucket-view": {"ddp_kwargs": {"find_unused_parameters": True,
                                                     "gradient_as_bucket_view": True}, "accum": 2},
    "explicit-find-unused-false-accum": {"ddp_kwargs": {"find_unused_parameters": False}, "accum": 2},
    "in-reentrant-checkpoint": {"checkpointed": True, "ddp_kwargs": {"find_unused_parameters": True}},
    "in-checkpoint-static-accum": {"checkpointed": False, "ddp_kwargs": {"static_graph": True}, "accum": 2},
    "dora": {"adapter": "dora", "ddp_kwargs": {"find_unused_parameters": True}},
    "full-finetune": {"adapter": "full", "ddp_kwargs": {"static_graph": True}},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_parity_across_ddp_modes(pool, mode):
    results = pool.run(stack_case, **MODES[mode])
    for r in results:
        assert r["max_rel_error"] <= 1e-9, r
        assert r["ranks_in_sync"]
        assert r["counts"]["tiled_calls"] > 0
    # the ranks ran different shard counts (different sequence lengths), which static_graph must tolerate
    assert results[0]["counts"]["shards"] != results[1]["counts"]["shards"]


def test_bf16_autocast_parity(pool):
    for r in pool.run(stack_case, dtype=torch.float32, autocast=True):
        assert r["max_rel_error"] <= 2e-2 and r["ranks_in_sync"]  # bf16 rounding; fp64 cases hold 1e-9


@pytest.mark.parametrize("family", list(mlp_models.MLP_CLASSES))
def test_each_family_mlp_class_tiles_with_parity(pool, family):
    for r in pool.run(stack_case, name=family, ddp_kwargs={"find_unused_parameters": True}):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"] and r["counts"]["tiled_calls"] > 0


def hook_count_case(accum: int) -> dict:
    """Count AccumulateGrad executions (where DDP's hook sits) per parameter per optimizer step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        model = DDP(mlp_models.build_stack("llama", adapter="lora"))
        fired: dict[str, int] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                fired[name] = 0
                p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.__setitem__(n, fired[n] + 1))
        rank = torch.distributed.get_rank()
        for micro in range(accum):
            ctx = model.no_sync() if micro < accum - 1 else torch.enable_grad()
            with ctx:
                mlp_models.stack_loss(model, mlp_models.stack_batch(rank, 0, micro)).backward()
        return {"fired": fired, "shards": tiled_mlp.counts()["shards"]}


@pytest.mark.parametrize("accum", [1, 2])
def test_each_ddp_hook_fires_once_per_backward(pool, accum):
    for r in pool.run(hook_count_case, accum=accum):
        assert r["shards"] >= 4 * accum
        assert r["fired"] and set(r["fired"].values()) == {accum}, r["fired"]


def dropout_case() -> dict:
    """LoRA dropout 0.3: the tiled backward must use the masks its forward drew (checked against running the
    same shards one after another with autograd, from the same RNG state); a wrong replay would not match."""
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        model = mlp_models.build_stack("llama", adapter="lora", dropout=0.3)
        x = mlp_models.stack_batch(torch.distributed.get_rank(), 0, 0)
        mlp = model.base_model.model.mlps[0]

        def grads(fn):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            fn().pow(2).sum().backward()
            return [p.grad.clone() for p in mlp.parameters() if p.requires_grad]

        with engines.acting_as(engines.DDP):  # the MLP as a DDP forward runs it
            tiled = grads(lambda: mlp(x))
        before = tiled_mlp.counts()["tiled_calls"]
        grads(lambda: mlp(x))  # outside any engine it steps aside (NOTE [Engines])
        stepped_aside = tiled_mlp.counts()["tiled_calls"] == before
        rows = x.reshape(-1, x.shape[-1])
        sizes = tiled_mlp.shard_sizes(rows.shape[0], x.shape[-1], SHARD)
        with tiled_mlp.untiled():
            by_shard = grads(lambda: torch.cat([mlp(s) for s in rows.split(sizes)]))
            whole = grads(lambda: mlp(x))
    return {
        "equal_to_shard_by_shard": all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(tiled, by_shard)),
        "dropout_active": not all(torch.allclose(a, b) for a, b in zip(tiled, whole)),
        "stepped_aside_outside_ddp": stepped_aside,
    }


def test_dropout_masks_are_replayed(pool):
    for r in pool.run(dropout_case):
        assert r["equal_to_shard_by_shard"]
        assert r["dropout_active"]
        assert r["stepped_aside_outside_ddp"]


def lm_case(family: str, qlora: bool, ddp_kwargs: dict, accum: int, ckpt_kwargs) -> dict:
    from ddp_patches.verify.hf_models import lm_parity

    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=5):
        result = lm_parity(family, ckpt_kwargs, qlora=qlora, ddp_kwargs=ddp_kwargs, accum=accum,
                           reference_context=tiled_mlp.untiled).as_dict()
        result["counts"] = tiled_mlp.counts()
    return result


@pytest.mark.parametrize("family,qlora,ddp_kwargs,accum,ckpt_kwargs,tol", [
    ("llama", False, {"find_unused_parameters": True}, 1, {"use_reentrant": True}, 1e-9),
    ("qwen2", False, {"static_graph": True}, 2, None, 1e-9),
    ("llama", True, {"find_unused_parameters": True}, 1, None, 1e-4),
], ids=["llama-lora-reentrant-find-unused", "qwen2-lora-static-accum", "llama-qlora"])
def test_hf_lm_parity(pool, family, qlora, ddp_kwargs, accum, ckpt_kwargs, tol):
    for r in pool.run(lm_case, family=family, qlora=qlora, ddp_kwargs=ddp_kwargs, accum=accum,
                      ckpt_kwargs=ckpt_kwargs):
        assert r["max_rel_error"] <= tol and r["ranks_in_sync"] and r["counts"]["tiled_calls"] > 0


def test_single_process_is_untouched():
    model = mlp_models.build_stack("llama")
    x = mlp_models.stack_batch(0, 0, 0)
    mlp_models.stack_loss(model, x).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        mlp_models.stack_loss(model, x).backward()
        assert tiled_mlp.counts()["tiled_calls"] == 0
    assert all(torch.equal(a, p.grad) for a, p in zip(expected, [p for p in model.parameters() if p.requires_grad]))


def test_shard_sizes_rule():
    """NOTE [Tiling by bytes]: min(ceil(5 I / H), T // H) shards, untiled below 2; an explicit size always wins."""
    assert tiled_mlp.shard_sizes(10, 16, 4) == [4, 3, 3]  # at most 4 per shard, evenly spread
    llama8b = {"hidden": 4096, "intermediate": 14336}
    shards = {t: len(tiled_mlp.shard_sizes(t, llama8b["hidden"], None, llama8b["intermediate"]))
              for t in (4095, 4096, 8191, 8192, 32768, 65536, 73728, 131072, 524288)}
    # a shard never under hidden_size tokens (ALST's size), and no more than 18 = ceil(5 x 3.5) for Llama-8B
    assert shards == {4095: 1, 4096: 1, 8191: 1, 8192: 2, 32768: 8, 65536: 16, 73728: 18, 131072: 18, 524288: 18}
    sizes = tiled_mlp.shard_sizes(524288, 4096, None, 14336)
    assert sum(sizes) == 524288 and max(sizes) - min(sizes) <= 1
    # one shard's intermediates (5 x I per token) are no larger than the call's hidden states (H per token)
    assert max(sizes) * 5 * 14336 <= 524288 * 4096
    # a narrow MLP (I < H / 5) gains nothing from tiling: one shard's intermediates already fit
    assert tiled_mlp.shard_sizes(1 << 16, 1024, None, 128) == [1 << 16]
    with pytest.raises(TypeError, match="intermediate="):
        tiled_mlp.shard_sizes(8192, 1024, None)


def test_revert_restores_every_mlp_forward():
    before = {name: vars(mlp_models.mlp_class(name))["forward"] for name in mlp_models.MLP_CLASSES}
    report = ddp_patches.apply(tiled_mlp=True)
    assert {f"{c.__module__}.{c.__qualname__}.forward" for c in map(mlp_models.mlp_class, mlp_models.MLP_CLASSES)} \
        <= set(report.installed)
    for name in mlp_models.MLP_CLASSES:
        assert vars(mlp_models.mlp_class(name))["forward"].__wrapped__ is before[name]
    ddp_patches.revert()
    assert all(vars(mlp_models.mlp_class(name))["forward"] is before[name] for name in mlp_models.MLP_CLASSES)


def test_state_dict_keys_unchanged():
    model = mlp_models.build_stack("qwen2")
    keys = list(model.state_dict())
    ddp_patches.apply(tiled_mlp=True)
    assert list(mlp_models.build_stack("qwen2").state_dict()) == keys


def _gated_class(name: str, *, mixes_tokens: bool = False, out: int = 16) -> type:
    """A gate/up/down MLP class made at call time (so no class walk at apply() could have seen it)."""
    from torch import nn

    def __init__(self):
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, out)

    def forward(self, x):
        up = self.up_proj(x)
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * (up.softmax(-2) if mixes_tokens else up))

    return type(name, (nn.Module,), {"__init__": __init__, "forward": forward})


def discovery_case() -> dict:
    """Three classes created after apply(), found when DDP wraps them: one tiles (with the untiled gradients),
    one mixes tokens and one changes the width (both run untiled, each logged once with its reason)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        classes = {"ok": _gated_class("NewFamilyMLP"), "mixing": _gated_class("TokenMixingMLP", mixes_tokens=True),
                   "narrowing": _gated_class("NarrowingMLP", out=8)}
        result = {}
        for key, cls in classes.items():
            torch.manual_seed(0)
            model = DDP(nn.Sequential(cls()).double())
            x = torch.randn(2, 9, 16, dtype=torch.float64)
            before = tiled_mlp.counts()["tiled_calls"]
            model(x).pow(2).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            with tiled_mlp.untiled():
                model(x).pow(2).sum().backward()
            result[key] = {"tiled": tiled_mlp.counts()["tiled_calls"] > before,
                           "patched": "__wrapped__" in vars(vars(cls)["forward"]),
                           "same_grads": all(torch.allclose(g, p.grad, rtol=1e-12, atol=1e-14)
                                             for g, p in zip(grads, model.parameters())),
                           "verdict": tiled_mlp.rules._verdicts.get(cls)}
    result["reverted"] = all("__wrapped__" not in vars(vars(c)["forward"]) for c in classes.values())
    return result


def test_mlps_found_by_structure_and_probed(pool):
    for r in pool.run(discovery_case):
        assert r["ok"] == {"tiled": True, "patched": True, "same_grads": True, "verdict": None}
        assert r["mixing"]["patched"] and not r["mixing"]["tiled"] and r["mixing"]["same_grads"]
        assert "depends on the other tokens" in r["mixing"]["verdict"]
        assert r["narrowing"]["patched"] and not r["narrowing"]["tiled"]
        assert "not to the same shape" in r["narrowing"]["verdict"]
        assert r["reverted"]


def auto_rule_case(tokens: int) -> dict:
    """No shard size given: the shards are decided by bytes (NOTE [Tiling by bytes])."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with ddp_patches.patched(tiled_mlp=True):
        model = DDP(mlp_models.build_stack("llama"))
        mlp_models.stack_loss(model, torch.randn(1, tokens, mlp_models.HIDDEN, dtype=torch.float64)).backward()
        return tiled_mlp.counts()


AUTO_CAP = math.ceil(tiled_mlp.SAVED_PER_TOKEN * mlp_models.INTERMEDIATE / mlp_models.HIDDEN)


@pytest.mark.parametrize("tokens,shards", [(2 * mlp_models.HIDDEN - 1, 1), (2 * mlp_models.HIDDEN, 2),
                                           (5 * mlp_models.HIDDEN, 5), (40 * mlp_models.HIDDEN, AUTO_CAP)])
def test_auto_rule_shards_by_bytes(pool, tokens, shards):
    """Untiled below two hidden_size shards; one shard per hidden_size tokens up to ceil(5 I / H), then no more."""
    for counts in pool.run(auto_rule_case, tokens=tokens):
        assert counts["tiled_calls"] == (0 if shards == 1 else 2), counts  # 2 MLPs in the stack
        assert counts["shards"] == (0 if shards == 1 else 2 * shards), counts


def vlm_case(lora_on_vision: bool) -> dict:
    from ddp_patches.verify.vlm_models import vlm_parity

    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=5):
        result = vlm_parity("qwen2_vl", {"use_reentrant": True}, lora_on_vision=lora_on_vision,
                                 reference_context=tiled_mlp.untiled).as_dict()
        result["counts"] = tiled_mlp.counts()
    return result


@pytest.mark.parametrize("lora_on_vision", [False, True], ids=["lora-text", "lora-text-and-vision"])
def test_qwen2_vl_parity_with_tiled_text_mlp(pool, lora_on_vision):
    """The text tower's Qwen2MLP tiles; the vision tower's fc1/fc2 VisionMlp is another shape and is left alone."""
    for r in pool.run(vlm_case, lora_on_vision=lora_on_vision):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"] and r["counts"]["tiled_calls"] > 0


def built_before_apply_case() -> dict:
    """The model and its DDP wrapper exist before apply(): the class-level patch still tiles its MLPs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(mlp_models.build_stack("qwen3"), find_unused_parameters=True)
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        mlp_models.stack_loss(model, mlp_models.stack_batch(torch.distributed.get_rank(), 0, 0)).backward()
        return {"tiled_calls": tiled_mlp.counts()["tiled_calls"],
                "grads": all(p.grad is not None and p.grad.abs().sum() > 0
                             for p in model.parameters() if p.requires_grad)}


def test_model_built_before_apply_is_tiled(pool):
    for r in pool.run(built_before_apply_case):
        assert r["tiled_calls"] == 2 and r["grads"]


def test_intermediate_size_read_or_measured():
    """I comes from gate_proj's ``out_features``; a gate_proj without one (a wrapper module) is measured once."""
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, gate):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = gate, nn.Linear(8, 24), nn.Linear(24, 8)

    x = torch.randn(3, 8)
    assert tiled_mlp.rules.intermediate_width(MLP(nn.Linear(8, 24)), x) == 24
    wrapped = MLP(nn.Sequential(nn.Linear(8, 24), nn.Identity()))
    assert tiled_mlp.rules.intermediate_width(wrapped, x) == 24
    assert tiled_mlp.rules.intermediate_width(wrapped, x) == 24  # cached: measured once


def penalty_loss(model, batch) -> torch.Tensor:
    """The stack's loss plus a gradient penalty on its input (create_graph=True: a double backward through every
    MLP, as in R1 / WGAN-GP regularisation). A list of batches (the reference): the mean over them."""
    if isinstance(batch, list):
        return sum(penalty_loss(model, b) for b in batch) / len(batch)
    batch = batch.detach().requires_grad_()
    out = model(batch)
    (grad_in,) = torch.autograd.grad(out.pow(2).sum(), batch, create_graph=True)
    return (out.pow(2).sum() + grad_in.pow(2).sum()) / mlp_models.NORM


def double_backward_case(patched: bool) -> dict:
    """2 ranks, different lengths: DDP with the gradient penalty, against the untiled full-batch reference; without
    the library, and with it (tiled in shards of SHARD tokens)."""
    from ddp_patches.verify.parity import run_parity

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ddp_patches").addHandler(handler)
    try:
        with library(patched, tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
            result = run_parity(lambda: mlp_models.build_stack("llama"), mlp_models.stack_batch, list, penalty_loss,
                                iters=2, lr=0.1, reference_context=tiled_mlp.untiled).as_dict()
            result["tiled_calls"] = tiled_mlp.counts()["tiled_calls"] if patched else 0
    finally:
        logging.getLogger("ddp_patches").removeHandler(handler)
    result["warnings"] = warnings
    return result


@pytest.mark.parametrize("patched", [False, True], ids=["without-library", "with-library"])
def test_double_backward_through_tiled_mlp_matches_untiled(pool, patched):
    """A gradient penalty differentiates the MLP's backward: the tiled backward must itself be differentiable
    (it returned constants, and the penalty's gradients were silently wrong)."""
    for r in pool.run(double_backward_case, patched=patched):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"] and not r["warnings"], r
        assert r["tiled_calls"] > 0 or not patched
