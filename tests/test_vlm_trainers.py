"""VLMs end to end: HF Trainer and TRL SFTTrainer on 2 CPU ranks with apply(), the way users configure them.

Every run must finish inside the pool's timeout (a hang is a failure), with a finite loss and LoRA weights
identical on both ranks. Offload (forced through the CPU path) and the tiled MLP are switched on in every run.
"""

from __future__ import annotations


import pytest

import ddp_patches
from ddp_patches.offload import offloader as offload
from ddp_patches.verify.vlm_models import SPECS

REENTRANT = {"use_reentrant": True}


def vlm_trainer_case(kind: str, family: str, *, patched: bool = True, **kwargs) -> dict:
    from ddp_patches import tiled_mlp
    from ddp_patches.offload import offloader as offload
    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.trainer_runs import train

    if not patched:
        return train(kind, family=family, **kwargs)
    forced = cpu_path_offloader()
    with ddp_patches.patched(offload=True, tiled_mlp=True, tiled_mlp_shard_tokens=4), offload.use_offloader(forced):
        result = train(kind, family=family, **kwargs)
        result["tiled_calls"] = tiled_mlp.counts()["tiled_calls"]
    result["offloaded"] = forced.last_step.offloaded_tensors if forced.last_step else 0
    result["offload_stats"] = forced.last_step.as_dict() if forced.last_step else None
    return result


# (LoRA on the vision tower too, checkpoint kwargs, ddp_static_graph, a rank that only ever sees text)
CONFIGS = {
    "lora-text-default-ckpt": dict(lora_on_vision=False, ckpt_kwargs=None, static_graph=None, text_only_rank=None),
    "lora-text-vision-reentrant-text-only-rank": dict(lora_on_vision=True, ckpt_kwargs=REENTRANT, static_graph=None,
                                                      text_only_rank=1),
    "lora-text-vision-static-text-only-rank": dict(lora_on_vision=True, ckpt_kwargs=REENTRANT, static_graph=True,
                                                   text_only_rank=1),
}


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["world_size"] == 2 and r["steps"] == 3
        assert r["finite"], r["losses"]
        assert r["lora_in_sync"]
        assert r["tiled_calls"] > 0
    # A text-only rank of a 2-layer text tower has nothing to move (first input: a grad leaf; last: kept). An
    # input the model's forward still holds when it is released (Qwen3-VL keeps ``inputs_embeds`` for its
    # deepstack) is moved but not counted as freed: it counts here as moved.
    moved = [r["offloaded"] + r["offload_stats"]["kept"].get(offload.SHARED, 0) for r in results if r["offload_stats"]]
    assert any(m > 0 for m in moved), [r["offload_stats"] for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", list(SPECS))
def test_hf_trainer_vlm(pool, family, config):
    _check(pool.run(vlm_trainer_case, kind="trainer", family=family, accum=2, **CONFIGS[config]))


@pytest.mark.parametrize("config", ["lora-text-default-ckpt", "lora-text-vision-reentrant-text-only-rank"])
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_trl_sft_vlm(pool, family, config):
    _check(pool.run(vlm_trainer_case, kind="sft", family=family, accum=2, **CONFIGS[config]))


def test_hf_trainer_vlm_qlora(pool):
    _check(pool.run(vlm_trainer_case, kind="trainer", family="qwen2_vl", accum=2, qlora=True,
                    **CONFIGS["lora-text-vision-reentrant-text-only-rank"]))


def test_unpatched_vlm_trainer_fails(pool):
    from tests.harness import RankError

    with pytest.raises(RankError, match="marked as ready twice|expect_autograd_hooks_|finished reduction"):
        pool.run(vlm_trainer_case, kind="trainer", family="qwen2_vl", patched=False, accum=2,
                 **CONFIGS["lora-text-vision-reentrant-text-only-rank"])


def vlm_parity_case(family: str, ckpt_kwargs, lora_on_vision: bool, ddp_kwargs: dict, accum: int,
                    text_only_rank) -> dict:
    from ddp_patches import tiled_mlp
    from ddp_patches.verify.vlm_models import vlm_parity

    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=4):
        return vlm_parity(family, ckpt_kwargs, lora_on_vision=lora_on_vision, ddp_kwargs=ddp_kwargs,
                          accum=accum, text_only_rank=text_only_rank, reference_context=tiled_mlp.untiled).as_dict()


@pytest.mark.parametrize("ckpt_kwargs,lora_on_vision,ddp_kwargs,accum,text_only_rank", [
    (REENTRANT, True, {"find_unused_parameters": True}, 1, 1),
    (None, True, {"static_graph": True}, 2, 1),
    (REENTRANT, False, {}, 2, None),
    ({}, True, {}, 1, None),
], ids=["reentrant-vision-lora-text-only-rank", "static-accum-text-only-rank", "defaults-accum", "empty-kwargs"])
@pytest.mark.slow
def test_qwen2_vl_gradient_parity(pool, ckpt_kwargs, lora_on_vision, ddp_kwargs, accum, text_only_rank):
    for r in pool.run(vlm_parity_case, family="qwen2_vl", ckpt_kwargs=ckpt_kwargs, lora_on_vision=lora_on_vision,
                      ddp_kwargs=ddp_kwargs, accum=accum, text_only_rank=text_only_rank):
        assert r["max_rel_error"] <= 1e-9 and r["ranks_in_sync"], r
