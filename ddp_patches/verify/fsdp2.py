"""FSDP2 (``fully_shard``) beside a local replica on the global batch; gradients compared every iteration.

``parity.run_parity`` with the model sharded as accelerate's ``fsdp_version: 2`` auto-wrap does it: ``fully_shard``
on every ``_no_split_modules`` block, then on the root. Gradients are gathered with ``full_tensor()``; gradient
accumulation uses ``set_requires_gradient_sync(False)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from .. import engines
from .parity import ParityResult, run_parity


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: every ModuleList entry whose class is in ``_no_split_modules`` (transformers),
    else the entries of the longest ModuleList."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    chosen = [layer for ml in lists for layer in ml if type(layer).__name__ in names]
    if chosen:
        return chosen
    return list(max(lists, key=len)) if lists else []


def shard(model: nn.Module, *, reshard_after_forward: bool = True, skip: tuple[str, ...] = (),
          unused_params: bool = False, mp_policy=None) -> nn.Module:
    """``fully_shard`` every decoder layer (except classes named in ``skip``: they join the root's group) and the
    root; ``unused_params`` turns on FSDP2's ``set_reduce_scatter_unused_params``; ``mp_policy``: a
    ``MixedPrecisionPolicy`` for every group."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"reshard_after_forward": reshard_after_forward, **({"mp_policy": mp_policy} if mp_policy else {})}
    for layer in decoder_layers(model):
        if type(layer).__name__ not in skip:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if unused_params:
        model.set_reduce_scatter_unused_params(True)
    return model


def run_fsdp2_parity(build: Callable[[], nn.Module], make_batch, combine, loss_fn, *,
                     reshard_after_forward: bool = True, shard_kwargs: dict | None = None, iters: int = 2,
                     lr: float = 0.5, **kwargs) -> ParityResult:
    """``parity.run_parity`` with the model sharded by ``shard`` instead of wrapped in DDP."""
    def wrap(model: nn.Module, **_ddp_kwargs) -> nn.Module:
        return shard(model, reshard_after_forward=reshard_after_forward, **(shard_kwargs or {}))

    return run_parity(build, make_batch, combine, loss_fn, wrap=wrap, stands_in_for=engines.FSDP2, iters=iters,
                      lr=lr, **kwargs)


def lm_fsdp2_parity(family: str = "qwen2", ckpt_kwargs: Any = None, *, qlora: bool = False, accum: int = 1,
                    reshard_after_forward: bool = True, iters: int = 2, dtype=torch.float64,
                    reference_context=contextlib.nullcontext) -> ParityResult:
    from .hf_models import build_lora_model, combine_lm, lm_batch, lm_loss

    return run_fsdp2_parity(
        lambda: build_lora_model(family, ckpt_kwargs, qlora=qlora, dtype=dtype),
        lm_batch, combine_lm, lm_loss,
        reshard_after_forward=reshard_after_forward, accum=accum, iters=iters,
        reference_context=reference_context,
    )


def vlm_fsdp2_parity(family: str = "qwen2_vl", ckpt_kwargs: Any = None, *, accum: int = 1, iters: int = 2,
                     text_only_rank: int | None = 1, reshard_after_forward: bool = True,
                     shard_kwargs: dict | None = None) -> ParityResult:
    """LoRA on the text and vision towers; ``text_only_rank`` never sees an image, so its vision LoRA is unused."""
    from .hf_models import combine_lm, lm_loss
    from .vlm_models import build_vlm, vlm_batch

    def batch(r, i, m):
        b = vlm_batch(family, r, i, m, text_only_rank=text_only_rank)
        return {k: (v.double() if v.is_floating_point() else v) for k, v in b.items()}

    return run_fsdp2_parity(
        lambda: build_vlm(family, ckpt_kwargs, lora_on_vision=True, dtype=torch.float64),
        batch, combine_lm, lm_loss,
        reshard_after_forward=reshard_after_forward, accum=accum, iters=iters, shard_kwargs=shard_kwargs,
    )
