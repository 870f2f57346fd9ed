"""Named end-to-end scenarios for the validation harness (``validate.py``): each runs on every rank and returns a
result dict.

A scenario passes when it finishes, its loss is finite, every rank holds the same trainable weights and, where
it has a full-batch reference, the gradient error is within its tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    run: Callable[[], dict]
    tolerance: float | None = 1e-9  # None: no gradient reference (trainer runs)
    apply_kwargs: dict = field(default_factory=dict)  # options of the patched side's apply()


def _raw(module, use_reentrant, accum=1, **ddp_kwargs):
    def run():
        from .raw_models import raw_parity

        return raw_parity(module, use_reentrant=use_reentrant, ddp_kwargs=ddp_kwargs, accum=accum).as_dict()

    return run


def _lm(family, ckpt_kwargs, accum=1, qlora=False, **ddp_kwargs):
    def run():
        from .hf_models import lm_parity

        return lm_parity(family, ckpt_kwargs, qlora=qlora, ddp_kwargs=ddp_kwargs, accum=accum).as_dict()

    return run


def _offload_stack(accum=2, **ddp_kwargs):
    """A reentrant 4-block stack with offload forced through the CPU path; patched, inputs must really move."""

    def run():
        import torch

        import ddp_patches
        from ddp_patches.offload import offloader as offload

        from .cpu_offload import cpu_path_offloader
        from .parity import run_parity
        from .raw_models import CheckpointStack, raw_batch

        forced = cpu_path_offloader()
        with offload.use_offloader(forced):
            result = run_parity(lambda: CheckpointStack(use_reentrant=True).double(), raw_batch, torch.cat,
                                lambda m, x: m(x[:, :-1]).pow(2).mean(), ddp_kwargs=ddp_kwargs, accum=accum).as_dict()
        result["offloaded_per_micro_step"] = forced.stats.offloaded_tensors
        if ddp_patches.is_applied() and forced.stats.offloaded_tensors == 0:
            raise AssertionError("offload was applied but moved no checkpoint input")
        return result

    return run


def _tiled_lm(family, ckpt_kwargs, accum=1, **ddp_kwargs):
    """LoRA LM whose MLPs run tiled when patched; the reference replica runs them untiled."""

    def run():
        from ddp_patches import is_applied, tiled_mlp

        from .hf_models import lm_parity

        result = lm_parity(family, ckpt_kwargs, ddp_kwargs=ddp_kwargs, accum=accum,
                           reference_context=tiled_mlp.untiled).as_dict()
        result["tiled_mlp_calls"] = tiled_mlp.counts()["tiled_calls"]
        if is_applied() and result["tiled_mlp_calls"] == 0:
            raise AssertionError("tiled_mlp was applied but no MLP ran tiled")
        return result

    return run


def _vlm(family, ckpt_kwargs, accum=1, lora_on_vision=True, text_only_rank=1, **ddp_kwargs):
    def run():
        from .vlm_models import vlm_parity

        return vlm_parity(family, ckpt_kwargs, lora_on_vision=lora_on_vision, ddp_kwargs=ddp_kwargs, accum=accum,
                          text_only_rank=text_only_rank).as_dict()

    return run


def _fsdp2_lm(ckpt_kwargs, accum=2, qlora=False, reshard_after_forward=True):
    """FSDP2 (fully_shard per decoder layer + root), Qwen2 LoRA; the MLPs run tiled when apply(tiled_mlp=True)."""

    def run():
        from ddp_patches import is_applied, tiled_mlp

        from .fsdp2 import lm_fsdp2_parity

        result = lm_fsdp2_parity("qwen2", ckpt_kwargs, qlora=qlora, accum=accum,
                                 reshard_after_forward=reshard_after_forward,
                                 reference_context=tiled_mlp.untiled).as_dict()
        result["tiled_mlp_calls"] = tiled_mlp.counts()["tiled_calls"] if is_applied() else 0
        return result

    return run


def _fsdp2_offload(accum=2):
    """FSDP2, Qwen2 LoRA with 4 layers and non-reentrant checkpoints; offload forced through the CPU path."""

    def run():
        import ddp_patches
        from ddp_patches.offload import offloader as offload

        from .cpu_offload import cpu_path_offloader
        from .fsdp2 import run_fsdp2_parity
        from .hf_models import build_lora_model, combine_lm, lm_batch, lm_loss

        forced = cpu_path_offloader()
        with offload.use_offloader(forced):
            result = run_fsdp2_parity(lambda: build_lora_model("qwen2", None, layers=4), lm_batch, combine_lm,
                                      lm_loss, accum=accum).as_dict()
        result["offloaded_per_micro_step"] = forced.stats.offloaded_tensors
        if ddp_patches.is_applied() and forced.stats.offloaded_tensors == 0:
            raise AssertionError("offload was applied but moved no checkpoint input under FSDP2")
        return result

    return run


def _fsdp2_vlm(ckpt_kwargs, accum=2):
    """FSDP2, Qwen2-VL LoRA on text + vision, rank 1 text-only: the vision blocks stay in the root's group and
    FSDP2 reduce-scatters zeros for parameters a rank did not use (set_reduce_scatter_unused_params)."""

    def run():
        from .fsdp2 import vlm_fsdp2_parity

        return vlm_fsdp2_parity("qwen2_vl", ckpt_kwargs, accum=accum, text_only_rank=1, shard_kwargs={
            "skip": ("Qwen2VLVisionBlock",), "unused_params": True}).as_dict()

    return run


def _compiled_lm(ckpt_kwargs, accum=2):
    """torch.compile around DDP (what accelerate's dynamo_backend does), aot_eager backend."""

    def run():
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .hf_models import lm_parity

        return lm_parity("qwen2", ckpt_kwargs, accum=accum,
                         wrap=lambda m, **kw: torch.compile(DDP(m, **kw), backend="aot_eager")).as_dict()

    return run


def _moe(family, ckpt_kwargs, accum=2, **ddp_kwargs):
    def run():
        from .moe_models import moe_parity

        return moe_parity(family, ckpt_kwargs, ddp_kwargs=ddp_kwargs, accum=accum).as_dict()

    return run


def _trainer(kind, **kwargs):
    def run():
        from .trainer_runs import train

        return train(kind, **kwargs)

    return run


SCENARIOS = [
    Scenario("raw-reentrant-twice", "layer checkpointed twice, reentrant, DDP defaults",
             _raw("twice", True)),
    Scenario("raw-reentrant-find-unused", "reentrant checkpoint, find_unused_parameters=True",
             _raw("once", True, find_unused_parameters=True)),
    Scenario("raw-static-graph-accum", "static_graph=True, gradient accumulation 2 (no_sync first)",
             _raw("once", False, accum=2, static_graph=True)),
    Scenario("raw-unused-on-one-rank", "branch used on rank 0 only (vision LoRA + text-only batch), defaults",
             _raw("unused_on_some_ranks", True)),
    Scenario("raw-dynamic-graph", "parameters alternate used/unused, reentrant, defaults",
             _raw("dynamic", True)),
    Scenario("raw-offload-stack", "4 reentrant checkpointed blocks, find_unused=True, accum 2, offload forced on",
             _offload_stack(find_unused_parameters=True), apply_kwargs={"offload": True}),
    Scenario("llama-lora-tiled-mlp", "Llama LoRA, reentrant, find_unused=True, MLP tiled in 5-token shards",
             _tiled_lm("llama", {"use_reentrant": True}, find_unused_parameters=True),
             apply_kwargs={"tiled_mlp": True, "tiled_mlp_shard_tokens": 5}),
    Scenario("llama-lora-trainer-ddp", "Llama LoRA, reentrant, find_unused=True (Trainer's PeftModel choice)",
             _lm("llama", {"use_reentrant": True}, find_unused_parameters=True)),
    Scenario("qwen2-lora-static-accum", "Qwen2 LoRA, {} kwargs (torch default: reentrant), static graph, accum 2",
             _lm("qwen2", {}, accum=2, static_graph=True)),
    Scenario("llama-qlora-find-unused", "Llama QLoRA (bnb nf4) via prepare_model_for_kbit_training, find_unused",
             _lm("llama", None, qlora=True, find_unused_parameters=True), tolerance=1e-4),
    Scenario("qwen2-vl-text-only-rank", "Qwen2-VL LoRA on text + vision, reentrant, rank 1 sees only text",
             _vlm("qwen2_vl", {"use_reentrant": True})),
    Scenario("gemma3-trainer-vlm", "HF Trainer, Gemma3 VLM, LoRA text + vision, rank 1 text-only, accum 2, "
             "offload + tiled MLP", _trainer("trainer", family="gemma3", ckpt_kwargs={"use_reentrant": True},
                                             lora_on_vision=True, text_only_rank=1),
             tolerance=None, apply_kwargs={"offload": True, "tiled_mlp": True, "tiled_mlp_shard_tokens": 4}),
    Scenario("qwen2-vl-sft-vlm", "TRL SFTTrainer, Qwen2-VL, LoRA text + vision, rank 1 text-only, static graph, "
             "accum 2", _trainer("sft", family="qwen2_vl", ckpt_kwargs={"use_reentrant": True}, lora_on_vision=True,
                                 text_only_rank=1, static_graph=True), tolerance=None),
    Scenario("qwen3-moe-lora-find-unused", "Qwen3-MoE LoRA on attention + experts + router, reentrant, "
             "find_unused=True, accum 2 (experts idle differently per rank)",
             _moe("qwen3_moe", {"use_reentrant": True}, find_unused_parameters=True)),
    Scenario("mixtral-moe-static-accum", "Mixtral LoRA on attention + experts + router, default kwargs, static "
             "graph, accum 2", _moe("mixtral", None, static_graph=True)),
    Scenario("hf-trainer-lora", "HF Trainer, LoRA, reentrant, ddp_static_graph, accum 2",
             _trainer("trainer", ckpt_kwargs={"use_reentrant": True}, static_graph=True), tolerance=None),
    Scenario("trl-sft-lora", "TRL SFTTrainer, LoRA, reentrant, ddp_static_graph, accum 2",
             _trainer("sft", ckpt_kwargs={"use_reentrant": True}, static_graph=True), tolerance=None),
    # Other engines: the patches must act where proven and step aside elsewhere, never break a working run.
    Scenario("fsdp2-lora-tiled-mlp", "FSDP2 per layer + root, Qwen2 LoRA, reentrant (kept), accum 2, MLP tiled",
             _fsdp2_lm({"use_reentrant": True}), apply_kwargs={"tiled_mlp": True, "tiled_mlp_shard_tokens": 5}),
    Scenario("fsdp2-lora-no-reshard", "FSDP2, reshard_after_forward=False, Qwen2 LoRA, {} kwargs, accum 2",
             _fsdp2_lm({}, reshard_after_forward=False)),
    Scenario("fsdp2-offload", "FSDP2, Qwen2 LoRA, 4 layers, non-reentrant, accum 2, offload forced on",
             _fsdp2_offload(), apply_kwargs={"offload": True}),
    Scenario("fsdp2-qlora", "FSDP2, Qwen2 QLoRA (bnb nf4) via prepare_model_for_kbit_training, accum 2",
             _fsdp2_lm(None, qlora=True), tolerance=1e-4),
    Scenario("fsdp2-vlm-text-only-rank", "FSDP2, Qwen2-VL LoRA text + vision, rank 1 text-only, reentrant, accum 2",
             _fsdp2_vlm({"use_reentrant": True})),
    Scenario("ddp-compiled-reentrant", "torch.compile(DDP) (aot_eager), Qwen2 LoRA, reentrant, accum 2",
             _compiled_lm({"use_reentrant": True})),
]

BY_NAME = {s.name: s for s in SCENARIOS}


def passed(scenario: Scenario, result: dict) -> bool:
    if scenario.tolerance is None:
        return bool(result.get("finite")) and bool(result.get("lora_in_sync"))
    return result["max_rel_error"] <= scenario.tolerance and bool(result["ranks_in_sync"])
