"""Named end-to-end scenarios for validate_ddp_fix.py: each runs on every rank and returns a result dict.

A scenario passes when it finishes, its loss is finite, every rank holds the same trainable weights and, where
it has a full-batch reference, the gradient error is within its tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    run: Callable[[], dict]
    tolerance: float | None = 1e-9  # None: no gradient reference (trainer runs)


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
    Scenario("llama-lora-trainer-ddp", "Llama LoRA, reentrant, find_unused=True (Trainer's PeftModel choice)",
             _lm("llama", {"use_reentrant": True}, find_unused_parameters=True)),
    Scenario("qwen2-lora-static-accum", "Qwen2 LoRA, {} kwargs (torch default: reentrant), static graph, accum 2",
             _lm("qwen2", {}, accum=2, static_graph=True)),
    Scenario("llama-qlora-find-unused", "Llama QLoRA (bnb nf4) via prepare_model_for_kbit_training, find_unused",
             _lm("llama", None, qlora=True, find_unused_parameters=True), tolerance=1e-4),
    Scenario("hf-trainer-lora", "HF Trainer, LoRA, reentrant, ddp_static_graph, accum 2",
             _trainer("trainer", ckpt_kwargs={"use_reentrant": True}, static_graph=True), tolerance=None),
    Scenario("trl-sft-lora", "TRL SFTTrainer, LoRA, reentrant, ddp_static_graph, accum 2",
             _trainer("sft", ckpt_kwargs={"use_reentrant": True}, static_graph=True), tolerance=None),
]

BY_NAME = {s.name: s for s in SCENARIOS}


def passed(scenario: Scenario, result: dict) -> bool:
    if scenario.tolerance is None:
        return bool(result.get("finite")) and bool(result.get("lora_in_sync"))
    return result["max_rel_error"] <= scenario.tolerance and bool(result["ranks_in_sync"])
