"""Stacks of the real Hugging Face MLP classes (the ones the tiled-MLP patch targets), for tiling parity runs.

Each rank gets its own sequence length per iteration, so shard counts differ between ranks and steps. The loss is
a sum over tokens divided by a fixed constant: DDP's average of the ranks' losses then equals the mean of the
per-rank losses the reference computes, whatever each rank's token count.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

HIDDEN, INTERMEDIATE, ROWS = 16, 32, 2
NORM = 1000.0

# name -> (modeling module, class, activation, extra constructor kwargs)
MLP_CLASSES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaMLP", "silu", {}),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralMLP", "silu", {}),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP", "silu", {}),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP", "silu", {}),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2MLP", "gelu_pytorch_tanh", {}),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3MLP", "gelu_pytorch_tanh", {}),
    "qwen2_vl-text": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2MLP", "silu", {}),
    "qwen2_5_vl-text": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2MLP", "silu", {}),
    "qwen2_5_vl-vision": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLMLP", "silu",
                          {"bias": True}),
    "qwen3_vl-text": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextMLP", "silu", {}),
}


def mlp_class(name: str) -> type:
    module, cls, _, _ = MLP_CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def build_mlp(name: str) -> nn.Module:
    _, _, act, kwargs = MLP_CLASSES[name]
    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act=act,
                             hidden_activation=act, mlp_bias=False)
    return mlp_class(name)(config, **kwargs)


class MLPStack(nn.Module):
    """A frozen input projection (so the first MLP's input does not require grad), then two residual MLPs."""

    def __init__(self, name: str = "llama", *, checkpointed: bool | None = None, three_d: bool = True):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.mlps = nn.ModuleList([build_mlp(name), build_mlp(name)])
        self.checkpointed = checkpointed  # None: no checkpoint; True/False: use_reentrant
        self.three_d = three_d  # False: 2-D (tokens x hidden) inputs, as Qwen vision towers use

    def forward(self, x):
        h = self.inp(x if self.three_d else x.reshape(-1, HIDDEN))
        for mlp in self.mlps:
            if self.checkpointed is None:
                h = h + mlp(h)
            else:
                h = h + checkpoint(mlp, h, use_reentrant=self.checkpointed)
        return h


def build_stack(name: str = "llama", *, adapter: str = "lora", checkpointed: bool | None = None,
                dropout: float = 0.0, dtype=torch.float64) -> nn.Module:
    """``adapter``: "lora", "dora" (magnitude parameters) or "full" (every MLP weight and bias trainable)."""
    torch.manual_seed(0)
    model = MLPStack(name, checkpointed=checkpointed, three_d="vision" not in name).to(dtype)
    if adapter == "full":
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=adapter == "dora",
                        target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def stack_batch(rank: int, it: int, micro: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * it + micro)
    seq = 7 + 3 * rank + it  # ranks and steps differ in length, hence in shard count
    return torch.randn(ROWS, seq, HIDDEN, generator=g, dtype=torch.float64).to(dtype)


def stack_loss(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, list):  # the reference: mean over the ranks' losses, as DDP averages gradients
        return sum(stack_loss(model, b) for b in batch) / len(batch)
    return model(batch).pow(2).sum() / NORM


def stack_parity(name: str = "llama", *, adapter: str = "lora", checkpointed: bool | None = None,
                 ddp_kwargs: dict | None = None, accum: int = 1, iters: int = 2, dtype=torch.float64,
                 autocast: bool = False):
    from ddp_patches.tiled_mlp import untiled

    from .parity import run_parity

    def loss(model, batch):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            return stack_loss(model, batch).float()

    return run_parity(
        lambda: build_stack(name, adapter=adapter, checkpointed=checkpointed, dtype=dtype),
        lambda r, i, m: stack_batch(r, i, m, dtype),
        list,
        loss,
        ddp_kwargs=ddp_kwargs,
        accum=accum,
        iters=iters,
        lr=0.1,
        reference_context=untiled,
    )
