"""Run DDP on every rank and, beside it, a local replica on the global batch; compare gradients every iteration.

Each rank regenerates every other rank's batch from a seed, so the full-batch reference needs no
communication and any wrong gradient, on any rank, shows up in that rank's comparison.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import engines
from .device import device, to_device

Batch = Any


@dataclass
class ParityResult:
    max_rel_error: float = 0.0
    iterations: int = 0
    losses: list[float] = field(default_factory=list)
    ranks_in_sync: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def relative_error(grad: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """max|g - g_ref| / max|g_ref|; a missing gradient counts as zeros (DDP may leave an unused one as None)."""
    if grad is None and ref is None:
        return 0.0
    grad = torch.zeros_like(ref) if grad is None else grad
    ref = torch.zeros_like(grad) if ref is None else ref
    diff = (grad.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def run_parity(
    build: Callable[[], nn.Module],
    make_batch: Callable[[int, int, int], Batch],
    combine: Callable[[list[Batch]], Batch],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    *,
    ddp_kwargs: dict | None = None,
    iters: int = 3,
    accum: int = 1,
    lr: float = 0.05,
    seed: int = 1234,
    reference_context: Callable[[], Any] = contextlib.nullcontext,
    wrap: Callable[..., nn.Module] = DDP,
    stands_in_for: str = engines.DDP,
) -> ParityResult:
    """Train ``iters`` optimizer steps under DDP and on a local full-batch replica; compare every step.

    ``make_batch(rank, iteration, micro_step)`` must be deterministic; ``combine`` concatenates the ranks'
    batches into the global one; ``loss_fn`` must be a mean over the batch (DDP averages over ranks).
    ``reference_context`` wraps the reference's forward and backward (e.g. ``tiled_mlp.untiled``). ``wrap`` builds
    the distributed model from the local one and the DDP kwargs (default: DDP; ``torch.compile`` around it; an
    FSDP2 ``fully_shard``), and ``stands_in_for`` names its engine, under which the replica runs
    (``engines.acting_as``: the patches act on it as on the model it is compared with).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    torch.manual_seed(seed)
    model = build().to(dev)
    torch.manual_seed(seed)
    reference = build().to(dev)
    placement = {"device_ids": [dev.index]} if dev.type == "cuda" else {}
    ddp = wrap(model, **placement, **(ddp_kwargs or {}))
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=lr)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=lr)
    result = ParityResult()
    for it in range(iters):
        for micro in range(accum):
            with contextlib.nullcontext() if micro == accum - 1 else _no_sync(ddp):
                loss = loss_fn(ddp, to_device(make_batch(rank, it, micro), dev)) / accum
                loss.backward()
            global_batch = to_device(combine([make_batch(r, it, micro) for r in range(world)]), dev)
            with reference_context(), engines.acting_as(stands_in_for):
                (loss_fn(reference, global_batch) / accum).backward()
            result.losses.append(float(loss.detach()))
        for (name, p), (_, q) in zip(_local(ddp).named_parameters(), reference.named_parameters()):
            if p.requires_grad:
                err = relative_error(full_tensor(p.grad), q.grad)
                if not math.isfinite(err):
                    raise FloatingPointError(f"non-finite gradient error at {name}, iteration {it}")
                result.max_rel_error = max(result.max_rel_error, err)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        result.iterations += 1
    result.ranks_in_sync = params_equal_across_ranks(_local(ddp))
    return result


def _local(model: nn.Module) -> nn.Module:
    """The module holding the parameters: DDP's (also under torch.compile), else the model (FSDP2 shards it in
    place)."""
    return model.module if isinstance(getattr(model, "_orig_mod", model), DDP) else model


@contextlib.contextmanager
def _no_sync(model: nn.Module):
    """Accumulate without synchronising: DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``."""
    if not hasattr(model, "set_requires_gradient_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor: gathered from its shards for an FSDP2 DTensor, else t itself."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def params_equal_across_ranks(model: nn.Module) -> bool:
    """True when every trainable parameter (gathered, if sharded) is bit-identical to rank 0's."""
    flat = torch.cat([full_tensor(p.detach()).reshape(-1).double() for p in model.parameters() if p.requires_grad])
    same_device = flat.device  # NCCL needs CUDA tensors, gloo CPU ones: stay where the parameters are
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    same = torch.tensor([float(torch.equal(flat, mine))], dtype=torch.float64, device=same_device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item() == 1.0)
