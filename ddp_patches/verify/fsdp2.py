"""FSDP2 (``fully_shard``) beside a local replica on the global batch; gradients compared every iteration.

The counterpart of ``parity.run_parity`` for FSDP2: ``fully_shard`` on every decoder layer and on the root (what
accelerate's ``fsdp_version: 2`` auto-wrap does with ``_no_split_modules``), gradients gathered with
``full_tensor()`` and compared with the replica's; gradient accumulation uses ``set_requires_gradient_sync``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import engines
from .parity import ParityResult, relative_error


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
          unused_params: bool = False) -> nn.Module:
    """``fully_shard`` every decoder layer (except classes named in ``skip``: they join the root's group) and the
    root; ``unused_params`` turns on FSDP2's ``set_reduce_scatter_unused_params``."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        if type(layer).__name__ not in skip:
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    if unused_params:
        model.set_reduce_scatter_unused_params(True)
    return model


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def run_fsdp2_parity(
    build: Callable[[], nn.Module],
    make_batch: Callable[[int, int, int], Any],
    combine: Callable[[list[Any]], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    reshard_after_forward: bool = True,
    shard_kwargs: dict | None = None,
    iters: int = 2,
    accum: int = 1,
    lr: float = 0.5,
    seed: int = 1234,
    reference_context: Callable[[], Any] = contextlib.nullcontext,
) -> ParityResult:
    """Train ``iters`` optimizer steps under FSDP2 and on a local full-batch replica; compare every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = shard(build(), reshard_after_forward=reshard_after_forward, **(shard_kwargs or {}))
    torch.manual_seed(seed)
    reference = build()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=lr)
    result = ParityResult()
    for it in range(iters):
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            loss = loss_fn(model, make_batch(rank, it, micro)) / accum
            loss.backward()
            global_batch = combine([make_batch(r, it, micro) for r in range(world)])
            with reference_context(), engines.acting_as(engines.FSDP2):  # the replica stands in for the model
                (loss_fn(reference, global_batch) / accum).backward()
            result.losses.append(float(loss.detach()))
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if p.requires_grad:
                err = relative_error(_full(p.grad), q.grad)
                if not math.isfinite(err):
                    raise FloatingPointError(f"non-finite gradient error at {name}, iteration {it}")
                result.max_rel_error = max(result.max_rel_error, err)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        result.iterations += 1
    result.ranks_in_sync = _full_params_equal(model)
    return result


def _full_params_equal(model: nn.Module) -> bool:
    flat = torch.cat([_full(p.detach()).reshape(-1).double() for p in model.parameters() if p.requires_grad])
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    same = torch.tensor([float(torch.equal(flat, mine))], dtype=torch.float64)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item() == 1.0)


def lm_fsdp2_parity(family: str = "qwen2", ckpt_kwargs: Any = None, *, qlora: bool = False, accum: int = 1,
                    reshard_after_forward: bool = True, iters: int = 2,
                    reference_context=contextlib.nullcontext) -> ParityResult:
    from .hf_models import build_lora_model, combine_lm, lm_batch, lm_loss

    return run_fsdp2_parity(
        lambda: build_lora_model(family, ckpt_kwargs, qlora=qlora),
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
