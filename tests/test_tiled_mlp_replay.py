"""The tiled backward replays what the forward read (NOTE [The replay reads what the forward read] in
ddp_patches/tiled_mlp/function.py): an in-place edit of a tensor the replay reads raises torch's own error, as untiled;
parameters substituted for one call (``torch.func.functional_call``: sharpness-aware minimisation, perturbed
weights; ``torch.nn.utils.parametrize``) are the ones differentiated.

Each case runs on 2 gloo ranks fed different data (and different lengths, so shard counts differ). Measured on the
code before this rule, tiled: a weight edited in place between forward and backward gave no error (untiled: "one of
the variables needed for gradient computation has been modified by an inplace operation") and the backward
replayed the edited weight (gradients 0.50 off); under ``functional_call`` (SAM's second pass) the MLP's weights
got no gradient at all (relative error 1.0 against a single process on the global batch).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parametrize

import ddp_patches
from ddp_patches import tiled_mlp
from ddp_patches.verify import mlp_models
from ddp_patches.verify.parity import params_equal_across_ranks, relative_error
from tests._helpers import library

SHARD = 4
INPLACE = "modified by an inplace operation"
RHO = 0.05  # SAM's radius; equal on every rank and in the reference


def _stack(model: nn.Module) -> mlp_models.MLPStack:
    return next(m for m in model.modules() if isinstance(m, mlp_models.MLPStack))


# -- an in-place edit between forward and backward ----------------------------------------------------------------
def _lora(mlp: nn.Module, part: str) -> torch.Tensor:
    return getattr(mlp.gate_proj, part)["default"].weight


# kind -> (MLP family, adapter, which MLP, the tensor to edit after the forward (None: the MLP's input), whether
# plain torch raises). Where plain torch does not (it saved no copy of that tensor: a bias, a frozen weight whose
# input does not require grad), its gradients are those of the forward that ran, computed from the intermediates
# it kept; a replay would read the edited tensor, so the tiled MLP raises torch's error there too.
EDITS = {
    "full-weight": ("llama", "full", 1, lambda mlp: mlp.gate_proj.weight, True),
    "lora-A": ("llama", "lora", 1, lambda mlp: _lora(mlp, "lora_A"), True),
    "lora-B": ("llama", "lora", 1, lambda mlp: _lora(mlp, "lora_B"), True),
    "frozen-base-weight": ("llama", "lora", 1, lambda mlp: mlp.down_proj.base_layer.weight, True),
    "input": ("llama", "lora", 1, None, True),  # kept by a forward pre-hook on the MLP itself (it still tiles)
    "bias": ("qwen2_5_vl-vision", "full", 1, lambda mlp: mlp.up_proj.bias, False),
    "frozen-weight-frozen-input": ("llama", "lora", 0, lambda mlp: mlp.gate_proj.base_layer.weight, False),
}


def inplace_case(kind: str, patched: bool) -> dict:
    """Forward through DDP, edit one tensor an MLP read (``add_`` under no_grad), backward: the error, or None.
    ``patched``: under apply(tiled_mlp=True) (tiled), else plain torch."""
    family, adapter, index, pick, _ = EDITS[kind]
    with library(patched, tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        model = mlp_models.build_stack(family, adapter=adapter)
        mlp = _stack(model).mlps[index]
        seen: list[torch.Tensor] = []
        mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        ddp = DDP(model)
        loss = mlp_models.stack_loss(ddp, mlp_models.stack_batch(dist.get_rank(), 0, 0))
        with torch.no_grad():
            (seen[0] if pick is None else pick(mlp)).add_(0.1)
        try:
            loss.backward()
            error = None
        except RuntimeError as exc:
            error = str(exc)
        tiled = tiled_mlp.counts()["tiled_calls"] if patched else 0
    return {"error": error, "tiled_calls": tiled}


@pytest.mark.parametrize("kind", list(EDITS))
def test_an_inplace_edit_before_backward_raises_as_untiled(pool, kind):
    """Measured before the rule, tiled: every kind but "input" ran the backward without an error, replaying the
    edited tensor ("full-weight", +0.1: gradients 0.50 off, relative, from the untiled ones of the forward that
    ran); "input" raised (the input was already saved by a node of its own). Without the library the
    kinds marked so raise torch's error ("one of the variables needed for gradient computation has been modified
    by an inplace operation"), the others give the gradients of the forward that ran."""
    plain = pool.run(inplace_case, kind=kind, patched=False)
    patched = pool.run(inplace_case, kind=kind, patched=True)
    for without, with_ in zip(plain, patched):
        assert (without["error"] is not None) == EDITS[kind][-1], without
        assert without["error"] is None or INPLACE in without["error"], without
        assert with_["tiled_calls"] > 0, with_
        assert with_["error"] is not None and INPLACE in with_["error"], with_


# -- parameters substituted for one call ----------------------------------------------------------------------------
def _loss(model: nn.Module, batch, params: dict | None = None) -> torch.Tensor:
    """The stack's loss, through torch.func.functional_call with ``params`` when given."""
    if isinstance(batch, list):  # the reference: mean over the ranks' losses, as DDP averages gradients
        return sum(_loss(model, b, params) for b in batch) / len(batch)
    out = model(batch) if params is None else torch.func.functional_call(model, params, (batch,))
    return out.pow(2).sum() / mlp_models.NORM


def _sam_step(model: nn.Module, batch, average) -> None:
    """Sharpness-aware minimisation: the gradient at w, then the loss at w + e (e = RHO g / |g|) through
    functional_call; the step's gradient is the second one."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    _loss(model, batch).backward()
    average()
    with torch.no_grad():
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values()))
        moves = {n: RHO * p.grad / norm for n, p in params.items()}
    for p in params.values():
        p.grad = None
    _loss(model, batch, {n: p + moves[n] for n, p in params.items()}).backward()
    average()


def _perturbed_step(model: nn.Module, batch, average) -> None:
    """Only the perturbed call (w + RHO sign(w)): an instance's first call substitutes its parameters."""
    moved = {n: p + RHO * p.detach().sign() for n, p in model.named_parameters() if p.requires_grad}
    _loss(model, batch, moved).backward()
    average()


class _Scaled(nn.Module):
    def forward(self, w):
        return 1.5 * w


def _parametrized(adapter: str) -> nn.Module:
    """Every gate_proj weight parametrized (w -> 1.5 w): full fine-tuning only (a LoRA base weight is frozen)."""
    model = mlp_models.build_stack("llama", adapter=adapter)
    for mlp in model.mlps:
        parametrize.register_parametrization(mlp.gate_proj, "weight", _Scaled())
    return model


def _cached_step(model: nn.Module, batch, average) -> None:
    """Forward and backward inside one ``parametrize.cached()`` block."""
    with parametrize.cached():
        _loss(model, batch).backward()
    average()


def _plain_step(model: nn.Module, batch, average) -> None:
    _loss(model, batch).backward()
    average()


def _plain(adapter: str) -> nn.Module:
    return mlp_models.build_stack("llama", adapter=adapter)


CALLS = {"sam": (_plain, _sam_step),
         "functional-call-first": (_plain, _perturbed_step),
         "parametrize": (_parametrized, _plain_step),
         "parametrize-cached": (_parametrized, _cached_step)}


def substituted_case(call: str, through: str, adapter: str, iters: int = 2) -> dict:
    """``through`` "ddp" (the call on the DDP wrapper) or "module" (on ``ddp.module``, gradients averaged by
    hand). Gradients compared every iteration with one process on the global batch, untiled."""
    build, step = CALLS[call]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ddp_patches").addHandler(handler)
    try:
        with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
            torch.manual_seed(0)
            model = build(adapter)
            torch.manual_seed(0)
            reference = build(adapter)
            ddp = DDP(model)
            errors = _train(ddp if through == "ddp" else ddp.module, model, reference, step, iters,
                            by_hand=through == "module")
            result = {"errors": errors, "tiled_calls": tiled_mlp.counts()["tiled_calls"],
                      "ranks_in_sync": params_equal_across_ranks(model)}
    finally:
        logging.getLogger("ddp_patches").removeHandler(handler)
    result["lines"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "untiled" in
                       r.getMessage()]
    return result


def _train(target: nn.Module, model: nn.Module, reference: nn.Module, step, iters: int, by_hand: bool) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)

    def average():  # what DDP does, by hand, for a model called through ddp.module
        for p in model.parameters():
            if by_hand and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    errors = []
    for it in range(iters):
        step(target, mlp_models.stack_batch(rank, it, 0), average)
        with tiled_mlp.untiled():
            step(reference, [mlp_models.stack_batch(r, it, 0) for r in range(world)], lambda: None)
        errors.append(max(relative_error(p.grad, q.grad)
                          for p, q in zip(model.parameters(), reference.parameters()) if p.requires_grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return errors


@pytest.mark.parametrize("through", ["ddp", "module"])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("call", ["sam", "functional-call-first"])
def test_functional_call_with_substituted_parameters_is_exact(pool, call, through, adapter):
    """Measured before the rule, tiled, "sam": through DDP relative error 1.0 at every iteration (the MLP weights
    got no gradient: the replay read the module's own parameters, restored by then, not the substituted ones);
    through ``ddp.module`` no trainable tensor had a gradient and the guard's gradient check failed on it.
    "functional-call-first" was exact but untiled, with a false WARNING: the outside-tensor check, run at that
    first call, walked from the substituted ``w + e`` to ``w`` and took ``w`` for a tensor from outside."""
    for r in pool.run(substituted_case, call=call, through=through, adapter=adapter):
        assert r["tiled_calls"] > 0 and not r["lines"], r
        assert max(r["errors"]) <= 1e-9 and r["ranks_in_sync"], r


@pytest.mark.parametrize("call", ["parametrize", "parametrize-cached"])
def test_a_parametrized_weight_is_exact(pool, call):
    """``torch.nn.utils.parametrize``: the replay recomputes the weight from its parametrization, so it is exact
    tiled. Under ``parametrize.cached()`` the weight is computed once, at its first access in the call: inside
    the tiled forward (no_grad) or the probes; measured before the rule, tiled: the backward raised "Trying to
    backward through the graph a second time". Such a call runs untiled, with one WARNING line."""
    results = pool.run(substituted_case, call=call, through="ddp", adapter="full")
    for r in results:
        assert max(r["errors"]) <= 1e-9 and r["ranks_in_sync"], r
        assert (r["tiled_calls"] > 0) == (call == "parametrize"), r
    assert len(results[0]["lines"]) == (call == "parametrize-cached") and not results[1]["lines"], results
