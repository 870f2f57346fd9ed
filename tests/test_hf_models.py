"""Tiny Llama / Qwen2 with PEFT LoRA (and QLoRA) under raw 2-rank DDP, parity with a full-batch replica."""

from __future__ import annotations

import pytest

from tests._helpers import library

TOL = 1e-9
QLORA_TOL = 1e-4  # fp32 compute on a 4-bit base
CKPT_KWARGS = {"none": None, "empty": {}, "reentrant": {"use_reentrant": True}, "unset": "unset"}
DDP_SETTINGS = {
    "default": {},
    "trainer-peft": {"find_unused_parameters": True},  # what the Trainer picks for a PeftModel
    "static": {"static_graph": True},
}


def lm_case(family, ckpt, ddp, accum, qlora=False, patched=True) -> dict:
    from ddp_patches.verify.hf_models import lm_parity

    with library(patched):
        return lm_parity(
            family, CKPT_KWARGS[ckpt], qlora=qlora, ddp_kwargs=DDP_SETTINGS[ddp], accum=accum
        ).as_dict()


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("ddp", list(DDP_SETTINGS))
@pytest.mark.parametrize("ckpt", list(CKPT_KWARGS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_parity(pool, family, ckpt, ddp, accum):
    for rank, r in enumerate(pool.run(lm_case, family=family, ckpt=ckpt, ddp=ddp, accum=accum)):
        assert r["max_rel_error"] <= TOL, f"rank {rank}: {r['max_rel_error']:.2e}"
        assert r["ranks_in_sync"]


@pytest.mark.parametrize("ddp,accum", [("trainer-peft", 1), ("static", 2), ("default", 2)])
def test_qlora_parity(pool, ddp, accum):
    """bitsandbytes nf4 base, prepare_model_for_kbit_training (reentrant {} kwargs), LoRA on top."""
    for rank, r in enumerate(pool.run(lm_case, family="llama", ckpt="empty", ddp=ddp, accum=accum, qlora=True)):
        assert r["max_rel_error"] <= QLORA_TOL, f"rank {rank}: {r['max_rel_error']:.2e}"
        assert r["ranks_in_sync"]


@pytest.mark.slow
@pytest.mark.parametrize("ddp,accum,expected", [
    ("trainer-peft", 1, "marked as ready twice"),
    ("static", 2, "expect_autograd_hooks_"),
])
def test_unpatched_lora_fails(pool, ddp, accum, expected):
    from tests.harness import RankError

    with pytest.raises(RankError, match=expected):
        pool.run(lm_case, family="llama", ckpt="reentrant", ddp=ddp, accum=accum, patched=False)
