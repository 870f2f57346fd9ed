"""Small modules in the shapes of PyTorch's own DDP-with-checkpointing tests (test_c10d_common.py).

They bind ``checkpoint`` at import time, as user code does, which is exactly what a patch of the
``torch.utils.checkpoint.checkpoint`` attribute alone would miss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH = 20


class CheckpointOnce(nn.Module):
    """One checkpointed layer."""

    def __init__(self, use_reentrant: bool = True):
        super().__init__()
        self.l1 = nn.Linear(WIDTH, WIDTH)
        self.l2 = nn.Linear(WIDTH, WIDTH)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        return checkpoint(self.l2, self.l1(x), use_reentrant=self.use_reentrant)


class CheckpointTwice(CheckpointOnce):
    """The same layer checkpointed twice (pipeline-style reuse)."""

    def forward(self, x):
        x = checkpoint(self.l2, self.l1(x), use_reentrant=self.use_reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


class CheckpointTwiceWeightSharing(CheckpointTwice):
    """CheckpointTwice with l1 and l2 sharing one weight."""

    def __init__(self, use_reentrant: bool = True):
        super().__init__(use_reentrant)
        self.l1.weight = self.l2.weight


class DynamicCheckpoint(CheckpointOnce):
    """Alternates which layer runs: each parameter is used every other forward."""

    def __init__(self, use_reentrant: bool = True):
        super().__init__(use_reentrant)
        self.count = 0

    def forward(self, x):
        layer = self.l1 if self.count % 2 else self.l2
        self.count += 1
        return checkpoint(layer, x, use_reentrant=self.use_reentrant)


class CheckpointNoGradInput(CheckpointOnce):
    """A checkpointed region whose only input does not require grad (frozen embedding in front)."""

    def __init__(self, use_reentrant: bool = True):
        super().__init__(use_reentrant)
        self.l1.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            h = self.l1(x)
        return checkpoint(self.l2, h, use_reentrant=self.use_reentrant).tanh() + self.l1(x).detach()


class UnusedOnSomeRanks(CheckpointOnce):
    """A "vision" branch that runs only for rows with an image; rank 1's batches never have one.

    The text-only rank gives the branch's parameters no gradient at all: the LoRA-on-a-vision-tower case.
    Input rows carry their flag in the last column (1.0: has an image).
    """

    def __init__(self, use_reentrant: bool = True):
        super().__init__(use_reentrant)
        self.vision = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        has_image, x = x[:, -1:], x[:, :-1]
        out = checkpoint(self.l2, self.l1(x), use_reentrant=self.use_reentrant)
        if bool(has_image.any()):
            out = out + checkpoint(self.vision, x, use_reentrant=self.use_reentrant) * has_image
        return out


class RanButUnused(CheckpointOnce):
    """A layer that runs every step and feeds nothing: Llava takes its image features from the vision tower's
    layer -2, so the last layer's parameters never get a gradient although their module ran."""

    def __init__(self, use_reentrant: bool = True):
        super().__init__(use_reentrant)
        self.last = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.l1(x)
        self.last(h)  # computed, never used
        return checkpoint(self.l2, h, use_reentrant=self.use_reentrant)


class _HiddenReentrant(torch.autograd.Function):
    """A home-made reentrant checkpoint (as in unsloth or older Megatron): forward under no_grad, recompute and
    ``torch.autograd.backward`` inside backward, so its parameters' hooks fire in a nested graph task."""

    @staticmethod
    def forward(ctx, layer, x):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class HiddenReentrant(CheckpointOnce):
    """l2 runs in a custom reentrant Function that no patch of torch.utils.checkpoint reaches."""

    def forward(self, x):
        return _HiddenReentrant.apply(self.l2, self.l1(x))


class CheckpointStack(nn.Module):
    """An input projection, then ``depth`` checkpointed blocks (the second with ``dropout``), like a decoder.

    Its checkpoint inputs are the blocks' input activations, non-leaf tensors: what offload moves to the host.
    """

    def __init__(self, use_reentrant: bool = False, depth: int = 4, width: int = WIDTH, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout if i == 1 else 0.0), nn.Tanh()) for i in range(depth)
        )
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return h


RAW_MODULES = {
    "once": CheckpointOnce,
    "twice": CheckpointTwice,
    "weight_sharing": CheckpointTwiceWeightSharing,
    "dynamic": DynamicCheckpoint,
    "no_grad_input": CheckpointNoGradInput,
    "unused_on_some_ranks": UnusedOnSomeRanks,
    "hidden_reentrant": HiddenReentrant,
    "ran_but_unused": RanButUnused,
}


def raw_batch(rank: int, it: int, micro: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * it + micro)
    x = torch.randn(rows, WIDTH, generator=g, dtype=torch.float64)
    has_image = torch.full((rows, 1), 1.0 if rank == 0 else 0.0, dtype=torch.float64)
    return torch.cat([x, has_image], dim=1)


def raw_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(_unwrap(model), UnusedOnSomeRanks):
        x = x[:, :-1]  # the image flag column is for UnusedOnSomeRanks only
    return model(x).pow(2).mean()


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def raw_parity(name: str, *, use_reentrant: bool, ddp_kwargs: dict, accum: int, iters: int = 3):
    from .parity import run_parity

    cls = RAW_MODULES[name]
    return run_parity(
        lambda: cls(use_reentrant).double(),
        raw_batch,
        lambda xs: torch.cat(xs),
        raw_loss,
        ddp_kwargs=ddp_kwargs,
        accum=accum,
        iters=iters,
    )
