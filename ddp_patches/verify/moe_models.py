"""Tiny MoE causal LMs with LoRA on attention, experts and router, for DDP parity and Trainer runs.

transformers 5.x keeps a MoE block's experts as fused 3-D parameters (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) and the router as a module holding a bare ``weight``; PEFT reaches both through
``target_parameters`` and everything ``nn.Linear`` (attention, shared experts, dense layers) through
``target_modules="all-linear"``. Which names those are is read from the built model, not listed per family.

Routing is made to leave experts idle, differently per rank and per step: 8 experts, top-2, 12 tokens per rank.
The load-balancing loss is off (the family default): it is a function of the whole batch's routing, so a
per-rank DDP average of it is not the single-process loss of the global batch (see the fix document).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import tiny
from .hf_models import lm_batch, lm_loss, lm_parity

# The supported MoE families that have a causal-LM class; Qwen3-VL-MoE runs in the VLM sweep.
FAMILIES = ("qwen2_moe", "qwen3_moe", "qwen3_5_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe")
PARITY_FAMILIES = ("qwen3_moe", "mixtral")
EXPERTS, TOP_K = 8, 2
SEQ = 6  # tokens per row; 2 rows per rank
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k")


def moe_config_extra(model_type: str, **extra) -> dict:
    """EXPERTS experts, TOP_K routed per token, for whichever field names the family uses."""
    defaults = tiny.config_class(model_type)().to_dict()
    out = {k: EXPERTS for k in _EXPERT_KEYS if k in defaults}
    out.update({k: TOP_K for k in _TOPK_KEYS if k in defaults})
    return {**out, **extra}


def expert_parameters(model: nn.Module) -> list[str]:
    """PEFT ``target_parameters`` suffixes: the fused 3-D expert weights and the routers' bare weights."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            continue
        for param_name, p in module.named_parameters(recurse=False):
            is_expert = p.dim() == 3
            is_router = param_name == "weight" and p.dim() == 2 and "router" in type(module).__name__.lower()
            if is_expert or is_router:
                names.add(f"{module_name.rsplit('.', 1)[-1]}.{param_name}")
    return sorted(names)


def build_moe_lora(family: str, ckpt_kwargs: Any = None, *, dtype=torch.float64, jitter: float | None = None,
                   preserve_rng_state: bool = True):
    """LoRA on attention, shared/dense MLPs, experts and router; checkpointing on with ``ckpt_kwargs``.

    ``jitter``: Mixtral/PhiMoE ``router_jitter_noise`` (random scaling of the router's input in training).
    """
    from peft import LoraConfig, get_peft_model

    extra = {"router_jitter_noise": jitter} if jitter is not None else {}
    model = tiny.build(family, **moe_config_extra(family, **extra)).to(dtype)
    if ckpt_kwargs is not None and not preserve_rng_state:
        ckpt_kwargs = {**ckpt_kwargs, "preserve_rng_state": False}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                      target_parameters=expert_parameters(model), init_lora_weights=False)
    model = get_peft_model(model, lora)
    model.train()
    return model


def moe_batch(rank: int, it: int, micro: int) -> dict:
    return lm_batch(rank, it, micro, seq=SEQ)


def moe_parity(family: str, ckpt_kwargs: Any = None, *, ddp_kwargs: dict | None = None, accum: int = 1,
               iters: int = 2):
    return lm_parity(family, ckpt_kwargs, ddp_kwargs=ddp_kwargs, accum=accum, iters=iters,
                     build=lambda: build_moe_lora(family, ckpt_kwargs), batch=moe_batch)


def idle_experts(model: nn.Module, batch: dict) -> list[int]:
    """Per MoE block, how many experts got no token from ``batch`` (forward only, read from the routers)."""
    counts: list[int] = []

    def hook(module, args, output):
        index = output[-1] if isinstance(output, tuple) else output
        if isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32):
            counts.append(EXPERTS - int(index.unique().numel()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if "router" in type(m).__name__.lower()]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return counts


def recompute_routing(family: str = "mixtral", ckpt_kwargs: Any = None, *, jitter: float = 0.5,
                      preserve_rng_state: bool = True, ddp_kwargs: dict | None = None) -> dict:
    """Router jitter on, under DDP: the checkpointed model's gradients against the same model run without
    checkpointing from the same RNG state. Equal only if each recompute drew the forward's noise, i.e. routed
    every token to the experts the forward chose. Returns the largest relative difference over iterations."""
    import torch.distributed as dist

    from .parity import DDP, relative_error

    rank = dist.get_rank()
    models = {}
    for checkpointed in (True, False):
        torch.manual_seed(0)
        model = build_moe_lora(family, ckpt_kwargs, jitter=jitter, preserve_rng_state=preserve_rng_state)
        if not checkpointed:
            model.activation_checkpointing_disable()
        models[checkpointed] = DDP(model, **(ddp_kwargs or {}))
    worst = 0.0
    for it in range(2):
        for model in models.values():
            torch.manual_seed(1000 + 10 * it + rank)  # the same noise for both, different per rank
            lm_loss(model, moe_batch(rank, it, 0)).backward()
        pairs = zip(models[True].module.parameters(), models[False].module.parameters())
        worst = max([worst] + [relative_error(p.grad, q.grad) for p, q in pairs if p.requires_grad])
        for model in models.values():
            model.zero_grad(set_to_none=True)
    return {"max_rel_error": worst}
