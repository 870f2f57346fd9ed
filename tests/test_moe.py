"""MoE causal LMs (fused 3-D experts, top-k routers) with LoRA on attention, experts and router under 2-rank DDP.

Each rank gets different tokens, so experts go idle differently per rank and per step (asserted, not assumed).
"""

from __future__ import annotations

import pytest

import ddp_patches
from ddp_patches.verify.moe_models import FAMILIES, PARITY_FAMILIES
from tests._helpers import library

TOL = 1e-9
CKPT = {"reentrant": {"use_reentrant": True}, "default": None}
DDP_CASES = {  # (DDP kwargs, accumulation steps)
    "default": ({}, 1),
    "find-unused-accum2": ({"find_unused_parameters": True}, 2),
    "static-accum2": ({"static_graph": True}, 2),
}


def parity_case(family, ckpt, ddp, patched=True) -> dict:
    from ddp_patches.verify.moe_models import moe_parity

    kwargs, accum = DDP_CASES[ddp]
    with library(patched):
        return moe_parity(family, CKPT[ckpt], ddp_kwargs=kwargs, accum=accum).as_dict()


@pytest.mark.slow
@pytest.mark.parametrize("ddp", list(DDP_CASES))
@pytest.mark.parametrize("ckpt", list(CKPT))
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_moe_lora_parity(pool, family, ckpt, ddp):
    for rank, r in enumerate(pool.run(parity_case, family=family, ckpt=ckpt, ddp=ddp)):
        assert r["max_rel_error"] <= TOL, f"rank {rank}: {r['max_rel_error']:.2e}"
        assert r["ranks_in_sync"]


@pytest.mark.slow
@pytest.mark.parametrize("ddp,expected", [("find-unused-accum2", "marked as ready twice"),
                                          ("static-accum2", "expect_autograd_hooks_")])
def test_unpatched_moe_fails(pool, ddp, expected):
    from tests.harness import RankError

    with pytest.raises(RankError, match=expected):
        pool.run(parity_case, family="mixtral", ckpt="reentrant", ddp=ddp, patched=False)


def idle_case(family) -> dict:
    import torch.distributed as dist

    from ddp_patches.verify.moe_models import build_moe_lora, idle_experts, moe_batch

    model = build_moe_lora(family)
    rank = dist.get_rank()
    return {"idle": [idle_experts(model, moe_batch(rank, it, 0)) for it in range(2)],
            "trainable": [n for n, p in model.named_parameters() if p.requires_grad]}


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_experts_go_idle_differently_and_all_parts_have_lora(pool, family):
    r0, r1 = pool.run(idle_case, family=family)
    assert r0["idle"] != r1["idle"], "both ranks routed alike: the test would not exercise idle experts"
    assert any(n > 0 for per_step in r0["idle"] + r1["idle"] for n in per_step)
    for part in ("q_proj.lora_A", "experts.lora_A", "gate.lora_A"):
        assert any(part in n for n in r0["trainable"]), part


def trainer_case(family, ckpt, static) -> dict:
    from ddp_patches.verify.trainer_runs import train

    with ddp_patches.patched():
        return train("trainer", family=family, ckpt_kwargs=CKPT[ckpt], static_graph=static, accum=2, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt,static", [("reentrant", None), ("default", True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_trains_under_hf_trainer(pool, family, ckpt, static):
    """LoRA on attention + experts + router; the Trainer's own DDP choice (find_unused=True for a PeftModel)."""
    for rank, r in enumerate(pool.run(trainer_case, family=family, ckpt=ckpt, static=static)):
        assert r["finite"] and r["steps"] == 2, f"rank {rank}: {r}"
        assert r["lora_in_sync"], f"rank {rank}: ranks drifted apart"


def routing_case(ckpt, preserve, patched=True) -> dict:
    from ddp_patches.verify.moe_models import recompute_routing

    with library(patched):
        return recompute_routing("mixtral", CKPT[ckpt] or {"use_reentrant": False}, preserve_rng_state=preserve)


@pytest.mark.parametrize("ckpt", list(CKPT))
def test_router_jitter_recompute_routes_as_forward(pool, ckpt):
    """Mixtral router jitter on: the checkpoint recompute draws the forward's noise, so the gradients equal
    those of the same model run without checkpointing from the same RNG state, exactly."""
    for r in pool.run(routing_case, ckpt=ckpt, preserve=True):
        assert r["max_rel_error"] == 0.0


def test_router_jitter_without_preserved_rng_is_a_clear_error(pool):
    """Unpatched this gives silently wrong gradients (reentrant) or a CheckpointError deep in backward."""
    from tests.harness import RankError

    with pytest.raises(RankError, match="preserve_rng_state=True"):
        pool.run(routing_case, ckpt="reentrant", preserve=False)


def unpatched_jitter_case() -> dict:
    return routing_case("reentrant", False, patched=False)


def test_router_jitter_without_preserved_rng_is_wrong_unpatched(pool):
    """What the clear error replaces: reentrant, unpatched, the gradients differ from the true ones."""
    for r in pool.run(unpatched_jitter_case):
        assert r["max_rel_error"] > 1e-3
