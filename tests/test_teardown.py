"""Teardown: a DDP stays usable after ``destroy_process_group()`` for everything that needs no collective.

The teardown patch releases a DDP's reducer when its group is destroyed
(NOTE [Reducer outliving its process group] in ddp_patches/rescue/teardown.py). What DDP's forward and a backward then
ask of it is NOTE [A DDP after its group was destroyed]: an evaluation forward with grad mode on and ``torch.autograd.grad`` of the output w.r.t. the
input work as without the library (and as the plain module); local accumulation under ``no_sync()`` works; a
backward that DDP would all-reduce, and DDP's broadcast of buffers, fail with a clear error instead of training
on local gradients (or, for the broadcast, a segfault); a new DDP on the same module trains again.

Each case builds its DDP on a group of its own (``dist.new_group``), so the pool's default group survives.
"""

from __future__ import annotations

import contextlib
import copy
import datetime

import torch

from tests._helpers import LibraryLog, library

LR = 0.1


def _batch(rank: int, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(100 + rank))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same replica on every rank
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _reference_after_one_step(model: torch.nn.Module, world: int) -> list[torch.Tensor]:
    """One SGD step of a single process on the global batch: the mean of the ranks' losses."""
    ref = copy.deepcopy(model)
    loss = sum(ref(_batch(r)).pow(2).mean() for r in range(world)) / world
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    return [p.detach().clone() for p in ref.parameters()]


@contextlib.contextmanager
def _library(patched: bool):
    with LibraryLog() as records, library(patched):
        yield records


def _trained_then_destroyed(model: torch.nn.Module, **ddp_kwargs):
    """A DDP on a group of its own, one synced training step on this rank's batch, then its group destroyed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    ddp = DDP(model, process_group=group, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ddp(_batch(dist.get_rank())).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.destroy_process_group(group)  # what trainer.end() does, with the Trainer still holding the DDP
    return ddp


def after_destroy_case(patched: bool) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    expected = _reference_after_one_step(model, world)
    with _library(patched) as records:
        ddp = _trained_then_destroyed(model)
        trained = max((p.detach() - e).abs().max().item() for p, e in zip(model.parameters(), expected))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7 + rank), requires_grad=True)

        # (d) local accumulation under no_sync(): DDP all-reduces nothing there, so it needs no group.
        with ddp.no_sync():
            ddp(x).pow(2).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        no_sync_error = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), local))
        model.zero_grad(set_to_none=True)

        # (a) an evaluation forward with grad mode on, through the wrapper.
        out = ddp(x)
        plain = model(x)
        # (b) the input gradient of that output (a saliency map, an adversarial step).
        (saliency,) = torch.autograd.grad(out.sum(), x)
        (plain_saliency,) = torch.autograd.grad(plain.sum(), x)
        grads_untouched = all(p.grad is None for p in model.parameters())

        # (c) a backward of a loss through that output: DDP would all-reduce it over the destroyed group. Not run
        # unpatched: there it is a collective on a shut-down group, which torch does not promise to run (so is the
        # next backward into the parameters, even through the module: the forward of (a) armed the reducer).
        backward, grads_after_refusal, local_after_refusal = "not run", None, None
        if patched:
            try:
                ddp(x).pow(2).sum().backward()
                backward = "no error"
            except RuntimeError as e:
                backward = str(e)
            grads_after_refusal = [None if p.grad is None else p.grad.abs().sum().item() for p in model.parameters()]
            # What the error advises then works: a local backward through the module (DDP's flag is cleared by the
            # backward it would have reduced, so it would not all-reduce this one either).
            model(x).pow(2).sum().backward()
            local_after_refusal = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), local))
    return {"trained": trained, "no_sync_error": no_sync_error, "out": out.detach(), "plain": plain.detach(),
            "saliency": saliency, "plain_saliency": plain_saliency, "grads_untouched": grads_untouched,
            "backward": backward, "grads_after_refusal": grads_after_refusal,
            "local_after_refusal": local_after_refusal, "warnings": records.messages}


def test_evaluation_and_input_gradients_after_destroy_match_the_unpatched_run(pool):
    unpatched = pool.run(after_destroy_case, patched=False)
    patched = pool.run(after_destroy_case, patched=True)
    for rank, (u, p) in enumerate(zip(unpatched, patched)):
        assert p["trained"] < 1e-6 and u["trained"] < 1e-6, (rank, p["trained"], u["trained"])  # global batch
        assert p["no_sync_error"] < 1e-6, (rank, p["no_sync_error"])
        for key in ("out", "saliency"):
            assert torch.allclose(p[key], u[key], atol=1e-6), (rank, key)  # as without the library
            assert torch.allclose(p[key], p["plain_" + key if key == "saliency" else "plain"], atol=1e-6), (rank, key)
        assert p["grads_untouched"]
        assert p["warnings"] == [], p["warnings"]  # no false alarm
    # The two ranks fed different inputs, so the outputs must differ: nothing was synchronised in evaluation.
    assert not torch.allclose(patched[0]["out"], patched[1]["out"])
    # (c) patched: refused before any gradient is written, with what to do; unpatched it all-reduces over the
    # destroyed group, which cannot survive freeing that group (NOTE [A DDP after its group was destroyed]).
    for p in patched:
        assert "process group was destroyed" in p["backward"] and "all-reduce" in p["backward"], p["backward"]
        assert "new DistributedDataParallel" in p["backward"] and "no_sync" in p["backward"], p["backward"]
        assert p["grads_after_refusal"] == [None] * 4, p["grads_after_refusal"]
        assert p["local_after_refusal"] < 1e-6, p["local_after_refusal"]


def buffers_case() -> dict:
    """A model with buffers: DDP broadcasts them from rank 0 before the next forward, which needs the group."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with _library(True):
        ddp = _trained_then_destroyed(model)
        ddp.eval()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
        try:
            with torch.no_grad():
                ddp(x)
            message = "no error"
        except RuntimeError as e:
            message = str(e)
        with torch.no_grad():
            local = ddp.module(x)  # the module itself, with this rank's buffers, needs nothing
    return {"message": message, "local": local.shape}


def test_a_buffer_broadcast_after_destroy_is_a_clear_error_not_a_crash(pool):
    """Before: process_group None reached dist._broadcast_coalesced, which segfaulted the rank."""
    for r in pool.run(buffers_case, timeout=60):
        assert "broadcast" in r["message"] and "buffers" in r["message"], r["message"]
        assert "process group was destroyed" in r["message"] and "ddp.module" in r["message"], r["message"]
        assert r["local"] == torch.Size([3, 2])


def rewrapped_case() -> dict:
    """After destroy and an evaluation forward with grad on, a new group and a new DDP on the same module train
    as a fresh DDP does: the released one's refusal must not follow the module."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    with _library(True) as records:
        old = _trained_then_destroyed(model)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7 + rank), requires_grad=True)
        torch.autograd.grad(old(x).sum(), x)  # (a) + (b): the released DDP now refuses a synced backward
        start = copy.deepcopy(model)
        expected = _reference_after_one_step(start, world)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
        new = DDP(model, process_group=group)
        opt = torch.optim.SGD(new.parameters(), lr=LR)
        new(_batch(rank)).pow(2).mean().backward()
        opt.step()
        error = max((p.detach() - e).abs().max().item() for p, e in zip(model.parameters(), expected))
        del new, opt
        dist.destroy_process_group(group)
    return {"error": error, "warnings": records.messages, "old_alive": old is not None}


def test_a_new_ddp_on_the_same_module_trains_after_destroy(pool):
    for r in pool.run(rewrapped_case):
        assert r["error"] < 1e-6, r["error"]  # synchronised: the single-process step on the global batch
        assert r["warnings"] == [], r["warnings"]
