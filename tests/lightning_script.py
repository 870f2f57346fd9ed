"""One Lightning pattern on 2 CPU ranks (gloo), run by tests/test_lightning.py as ``python lightning_script.py
PATTERN OUT [--apply]``: Lightning starts the second rank itself by running this file again with the same
arguments, so ``--apply`` calls ``ddp_patches.apply()`` at the top of every rank, as a user's script would.

Patterns (the users' settings; each rank gets different data):
  static-accum      Trainer, ``DDPStrategy(static_graph=True)``, ``accumulate_grad_batches=2`` (casanovo#512)
  reentrant-unused  Trainer, ``find_unused_parameters=True``, blocks under ``checkpoint(use_reentrant=True)``
  rank-branch       Trainer, ``find_unused_parameters=False``, a head only rank 0 uses
  fabric-static     Fabric, ``DDPStrategy(static_graph=True)``, ``fabric.no_backward_sync`` on the first of 2
                    micro-steps, ``fabric.backward``

``--collective-timeout=S``: once the process group is up, its collectives time out after S seconds (a rank waiting
for one that failed), not 300 s, which also bounds the ranks' rendezvous on a busy machine.

Each rank writes OUT/rank<r>.pt: the averaged gradients before each optimizer step, the final trainable weights,
and whether the library was applied in that process. ``reference(pattern)`` is the same training in one process on
the global batch (both ranks' micro-batches), which the test compares with.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

PATTERNS = ("static-accum", "reentrant-unused", "rank-branch", "fabric-static")
WORLD, BATCH, STEPS, LR, DIM = 2, 4, 3, 0.1, 8
TIMEOUT = datetime.timedelta(seconds=300)
COLLECTIVE_TIMEOUT: datetime.timedelta | None = None


def accumulation(pattern: str) -> int:
    return 2 if pattern in ("static-accum", "fabric-static") else 1


def ddp_kwargs(pattern: str) -> dict:
    return {"static-accum": {"static_graph": True}, "reentrant-unused": {"find_unused_parameters": True},
            "rank-branch": {"find_unused_parameters": False}, "fabric-static": {"static_graph": True}}[pattern]


class Block(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter (LoRA's shape)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(DIM, DIM).requires_grad_(False)
        self.lora_a = nn.Linear(DIM, 2, bias=False)
        self.lora_b = nn.Linear(2, DIM, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class Net(nn.Module):
    def __init__(self, pattern: str):
        super().__init__()
        torch.manual_seed(0)
        self.pattern = pattern
        self.inp = nn.Linear(DIM, DIM)  # trainable before the checkpoints: their inputs require grad
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.extra = nn.Linear(DIM, 1).requires_grad_(pattern == "rank-branch")  # only rank 0's forward uses it
        for b in self.blocks:
            nn.init.normal_(b.lora_b.weight, std=0.1)  # LoRA starts B at zero; non-zero keeps every gradient alive
        self.double()

    def forward(self, x, rank: int):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True) if self.pattern == "reentrant-unused" else block(h)
        out = self.head(h)
        if self.pattern == "rank-branch" and rank == 0:
            out = out + self.extra(h)
        return out


def data(pattern: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x[rank, micro], y[rank, micro]: different data on each rank."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * accumulation(pattern)
    x = torch.randn(WORLD, n, BATCH, DIM, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).sin()


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if p.requires_grad}


def reference(pattern: str) -> dict:
    """One process, the global batch: each micro-step's loss is the mean of the ranks' losses (DDP's average)."""
    model, (x, y) = Net(pattern), data(pattern)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    accum, steps = accumulation(pattern), []
    for s in range(STEPS):
        for m in range(accum):
            i = s * accum + m
            loss = sum(nn.functional.mse_loss(model(x[r, i], r), y[r, i]) for r in range(WORLD)) / WORLD
            (loss / accum).backward()
        steps.append(grads(model))
        opt.step()
        opt.zero_grad()
    return {"grads": steps, "weights": trainable(model)}


def _shorten_collective_timeout() -> None:
    if COLLECTIVE_TIMEOUT is not None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(COLLECTIVE_TIMEOUT)


def _save(out: str, rank: int, steps: list, model: nn.Module) -> None:
    import ddp_patches

    torch.save({"grads": steps, "weights": trainable(model), "applied": ddp_patches.is_applied()},
               os.path.join(out, f"rank{rank}.pt"))


def run_trainer(pattern: str, out: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    x, y = data(pattern)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(pattern)
            self.steps = []

        def training_step(self, batch, _):
            bx, by = batch
            return nn.functional.mse_loss(self.net(bx, self.global_rank), by)

        def setup(self, stage):
            _shorten_collective_timeout()

        def on_before_optimizer_step(self, optimizer):
            self.steps.append(grads(self.net))

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

        def train_dataloader(self):
            r = self.global_rank
            return torch.utils.data.DataLoader(list(zip(x[r], y[r])), batch_size=None)  # one micro-batch each

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, accumulate_grad_batches=accumulation(pattern),
        strategy=DDPStrategy(timeout=TIMEOUT, **ddp_kwargs(pattern)),
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    _save(out, trainer.global_rank, module.steps, module.net)


def run_fabric(pattern: str, out: str) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=WORLD,
                    strategy=DDPStrategy(timeout=TIMEOUT, **ddp_kwargs(pattern)))
    fabric.launch()
    _shorten_collective_timeout()
    x, y = data(pattern)
    net = Net(pattern)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR)
    model, opt = fabric.setup(net, opt)
    rank, accum, steps = fabric.global_rank, accumulation(pattern), []
    for s in range(STEPS):
        for m in range(accum):
            i = s * accum + m
            with fabric.no_backward_sync(model, enabled=m < accum - 1):
                loss = nn.functional.mse_loss(model(x[rank, i], rank), y[rank, i])
                fabric.backward(loss / accum)
        steps.append(grads(net))
        opt.step()
        opt.zero_grad()
    _save(out, rank, steps, net)


def main(argv: list[str]) -> None:
    global COLLECTIVE_TIMEOUT
    for a in [a for a in argv if a.startswith("--collective-timeout=")]:
        COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(a.split("=", 1)[1]))
        argv.remove(a)
    pattern, out = argv[0], argv[1]
    if pattern not in PATTERNS:
        raise SystemExit(f"expected a pattern among {', '.join(PATTERNS)}, found {pattern!r}")
    (run_fabric if pattern.startswith("fabric") else run_trainer)(pattern, out)


if __name__ == "__main__":
    if "--apply" in sys.argv:
        import ddp_patches

        ddp_patches.apply()
    main([a for a in sys.argv[1:] if a != "--apply"])
