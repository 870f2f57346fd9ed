"""transformers' own checkpoint offload beside this library's (NOTE [One offload at a time] in ddp_patches/offload/offloader.py).

``activation_checkpointing_enable(offload=True)`` wraps every checkpoint call in
``torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=<accelerator or "cpu">)``. On a host without CUDA that
asks for pinned memory and fails at the first pack, with or without this library (pinned by a test below). To run
the combination on CPU, the other tests make transformers' accelerator query answer "cuda": save_on_cpu then takes
its unpinned copy path, the same pack and unpack it runs where pinning is possible. Its packs are counted through a
subclass whose pack hook wraps the original (functools.wraps keeps the name the library recognises).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import pytest
import torch

import ddp_patches
from tests._helpers import library, library_warnings, reentrant_nodes

ONE_OFFLOAD = "checkpoints run inside torch.autograd.graph.save_on_cpu"


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    packs = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        @functools.wraps(pack)
        def counted(tensor):
            _CountingSaveOnCpu.packs += 1
            return pack(tensor)

        self.pack_hook = counted


@contextlib.contextmanager
def _transformers_offload_runs_on_cpu() -> Iterator[type]:
    """transformers' save_on_cpu counted, and its device query answering "cuda" (unpinned copies on this host)."""
    import transformers.modeling_utils as modeling_utils

    saved = modeling_utils.save_on_cpu, modeling_utils.get_current_accelerator
    modeling_utils.save_on_cpu = _CountingSaveOnCpu
    modeling_utils.get_current_accelerator = lambda: torch.device("cuda")
    _CountingSaveOnCpu.packs = 0
    try:
        yield _CountingSaveOnCpu
    finally:
        modeling_utils.save_on_cpu, modeling_utils.get_current_accelerator = saved


def _lora_llama(offload: bool, ckpt_kwargs: dict):
    from peft import LoraConfig, get_peft_model

    from ddp_patches.verify.hf_models import LORA_TARGETS, build_causal_lm

    model = build_causal_lm("llama", dtype=torch.float32)
    model.activation_checkpointing_enable(ckpt_kwargs, offload=offload)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM"))
    model.train()
    return model


def both_offloads(ours: bool, ckpt_kwargs: dict) -> dict:
    """DDP parity of LoRA with transformers' offload=True (and ours when ``ours``) against a single process on the
    global batch without any offload."""
    from ddp_patches.offload import offloader as offload
    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.hf_models import combine_lm, lm_batch, lm_loss
    from ddp_patches.verify.parity import run_parity

    with library_warnings() as lines, _transformers_offload_runs_on_cpu() as counting, \
            ddp_patches.patched(offload=ours):
        forced = cpu_path_offloader()  # ours on CPU tensors: it acts unless something stands in its way
        builds = iter([lambda: _lora_llama(True, ckpt_kwargs), lambda: _lora_llama(False, ckpt_kwargs)])
        with offload.use_offloader(forced) if ours else contextlib.nullcontext():  # DDP, then the reference
            result = run_parity(lambda: next(builds)(), lm_batch, combine_lm, lm_loss, iters=2).as_dict()
        # One more step of the DDP model alone, counting what each offload packs (the reference has no
        # transformers offload, so ours acts on it above: that is not a second copy of the same tensors).
        forced, counting.packs = cpu_path_offloader(), 0
        with offload.use_offloader(forced) if ours else contextlib.nullcontext():
            model = torch.nn.parallel.DistributedDataParallel(_lora_llama(True, ckpt_kwargs))
            loss = lm_loss(model, lm_batch(0, 0, 0))
            result["reentrant_nodes"] = reentrant_nodes(loss)
            loss.backward()
    stats = forced.last_step or forced.stats
    return {**result, "theirs": counting.packs, "ours": stats.offloaded_tensors + stats.kept_last, "log": lines}


@pytest.mark.parametrize("ours", [False, True], ids=["apply()", "apply(offload=True)"])
@pytest.mark.parametrize("ckpt_kwargs", [{"use_reentrant": True}, {"use_reentrant": False}],
                         ids=["reentrant", "non-reentrant"])
def test_one_offload_acts_and_gradients_equal_no_offload(pool, ours, ckpt_kwargs):
    results = pool.run(both_offloads, ours=ours, ckpt_kwargs=ckpt_kwargs)
    for r in results:
        assert r["max_rel_error"] <= 1e-6 and r["ranks_in_sync"], r
        assert r["theirs"] > 0 and r["ours"] == 0, r  # transformers' offload acts, ours never on the same tensors
        assert r["reentrant_nodes"] == 0  # the swap ran inside transformers' wrapper
    lines = [ln for ln in results[0]["log"] if ONE_OFFLOAD in ln]
    if not ours and not ckpt_kwargs["use_reentrant"]:
        assert not lines, lines  # the library changed nothing about these checkpoints: nothing to say
        return
    assert len(lines) == 1, results[0]["log"]
    assert ("steps aside for these checkpoints" in lines[0]) == ours and ("is off" in lines[0]) != ours, lines
    assert not results[1]["log"] or not any(ONE_OFFLOAD in ln for ln in results[1]["log"])  # rank 0 only


def transformers_offload_on_this_host(patched: bool) -> str:
    """The first step of a DDP LoRA model with transformers' offload=True, as it is on this host: the error."""
    from ddp_patches.verify.hf_models import lm_batch, lm_loss

    with library(patched):
        model = torch.nn.parallel.DistributedDataParallel(_lora_llama(True, {"use_reentrant": True}))
        try:
            lm_loss(model, lm_batch(torch.distributed.get_rank(), 0, 0)).backward()
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure is that of a host without CUDA")
def test_on_a_host_without_cuda_transformers_offload_fails_as_without_the_library(pool):
    unpatched = pool.run(transformers_offload_on_this_host, patched=False)
    patched = pool.run(transformers_offload_on_this_host, patched=True)
    assert unpatched == patched
    assert all("pin_memory=True requires" in r for r in patched), patched
