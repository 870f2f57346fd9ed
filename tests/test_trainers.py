"""HF Trainer and TRL SFTTrainer on 2 CPU ranks (use_cpu=True, gloo), configured the way that fails today."""

from __future__ import annotations

import pytest

from tests._helpers import library


def trainer_case(kind, ckpt_kwargs, static_graph, find_unused=None, accum=2, qlora=False, patched=True) -> dict:
    from ddp_patches.verify.trainer_runs import train

    with library(patched):
        return train(kind, ckpt_kwargs=ckpt_kwargs, static_graph=static_graph, find_unused=find_unused,
                     accum=accum, qlora=qlora)


@pytest.mark.parametrize(
    "kind,ckpt_kwargs,static_graph",
    [
        ("trainer", {"use_reentrant": True}, True),
        ("trainer", {"use_reentrant": True}, None),
        ("trainer", {}, None),
        ("sft", {"use_reentrant": True}, True),
        ("sft", {"use_reentrant": True}, None),
    ],
    ids=["trainer-reentrant-static", "trainer-reentrant", "trainer-empty-kwargs", "sft-reentrant-static",
         "sft-reentrant"],
)
def test_trainer_runs(pool, kind, ckpt_kwargs, static_graph):
    results = pool.run(trainer_case, kind=kind, ckpt_kwargs=ckpt_kwargs, static_graph=static_graph)
    for r in results:
        assert r["world_size"] == 2
        assert r["steps"] == 3
        assert r["finite"], r["losses"]
        assert r["lora_in_sync"]
    assert results[0]["losses"] == results[1]["losses"]  # the Trainer logs the loss averaged over ranks


def test_trainer_qlora(pool):
    results = pool.run(trainer_case, kind="trainer", ckpt_kwargs=None, static_graph=None, qlora=True)
    assert all(r["finite"] and r["lora_in_sync"] and r["steps"] == 3 for r in results)


def test_unpatched_trainer_fails(pool):
    from tests.harness import RankError

    with pytest.raises(RankError, match="expect_autograd_hooks_"):
        pool.run(trainer_case, kind="trainer", ckpt_kwargs={"use_reentrant": True}, static_graph=True, patched=False)
