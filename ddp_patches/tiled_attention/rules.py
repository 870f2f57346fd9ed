"""Whether a tiled attention call tiles, and in how many shards.

``shard_sizes`` / ``auto_shards`` give the shards (NOTE [Attention tiled by bytes]). A class tiles once it owns
q/k/v/o_proj and its probe showed tiled and untiled outputs agree (NOTE [The attention's own forward runs]); a
call runs untiled where hooks, a cached parametrization or a trainable tensor from outside would see the shards;
a norm around the MLP tiles once proven row-wise (NOTE [The other norms tiled]). The settings ``install()`` sets,
and the verdicts ``forget()`` clears at revert(), live here.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Callable

import torch

from .. import engines, tiled_mlp
from .._registry import REGISTRY
from ..distributed import is_distributed, log_rank0_once
from .call import _PROJ, _children, _hidden, _in_shard, _inside, _modules_of, _params, _projection, _tiled_call

# For NOTE [Attention tiled by bytes]: the automatic shard count.
AUTO_SHARDS = 4

_settings: dict = {"on": False, "shard_tokens": None}
_verdicts: dict[type, str | None] = {}  # attention class -> None (tiles) or why not; decided at its first call
_outside: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()
_rowwise: dict[type, str | None] = {}  # norm class -> None (row by row) or why not; its first tiled call


def forget() -> None:
    _settings.update(on=False, shard_tokens=None)
    _verdicts.clear()
    _rowwise.clear()
    _outside.clear()


REGISTRY.on_reset(forget)


# NOTE [Attention tiled by bytes]
# Invariant: the automatic rule takes the projections' float32 working set off the layer's peak, reading only
# shapes (every rank and step of one length shards alike). Measured with memsim's machinery (one Llama-8B LoRA
# bf16 decoder layer, checkpointed, tiled MLP on): untiled the peak is 25.5 hidden-state tensors (51.1 GiB at
# 262K tokens), tiled 15.5 (31.0 GiB) for every shard count from 2 to 64: the shards' part (about 10 such tensors
# untiled, the float32 LoRA inputs and norm upcast) is then under what the attention kernel's backward holds.
# Rule: AUTO_SHARDS shards (margin over 2), never shards under hidden_size tokens (untiled below 2 shards);
# ``tiled_attention_shard_tokens`` is the user's explicit choice and is always honoured.
# Test: tests/test_tiled_attention.py::test_auto_rule.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
def auto_shards(rows: int, hidden: int) -> int:
    """Shards for a call of ``rows`` tokens (1: untiled). NOTE [Attention tiled by bytes]."""
    if hidden <= 0:
        return 1
    count = min(AUTO_SHARDS, rows // hidden)
    return count if count >= 2 else 1


def shard_sizes(rows: int, hidden: int, shard_tokens: int | None) -> list[int]:
    """Rows per shard, evenly split: at most ``shard_tokens`` each, or as many as ``auto_shards`` says."""
    count = max(1, math.ceil(rows / shard_tokens)) if shard_tokens is not None else auto_shards(rows, hidden)
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _probe(attn: torch.nn.Module, original_forward: Callable, args: tuple, kwargs: dict) -> str | None:
    """Whether the class tiles exactly: NOTE [The attention's own forward runs] (its first call, no_grad)."""
    hidden = _hidden(args, kwargs)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return "its forward takes no hidden_states tensor [..., tokens, H]"
    rows = hidden.numel() // hidden.shape[-1]
    if rows < 2:
        return None  # decided at a longer call
    devices = [hidden.device] if hidden.device.type == "cuda" else []
    stats: list = []
    try:
        with torch.no_grad(), tiled_mlp.dropout_off(attn), \
                torch.random.fork_rng(devices=devices, device_type="cuda"):
            whole = _first(original_forward(attn, *args, **kwargs))
            tiled = _first(_tiled_call(attn, original_forward, args, kwargs,
                                       lambda r, h: [r - r // 2, r // 2], stats=stats))
    except Exception as exc:  # noqa: BLE001 - a forward the stand-ins do not fit: untiled
        return f"its forward fails with its projections given ({type(exc).__name__}: {str(exc)[:120]})"
    odd = [f"{name} used {used}x, called otherwise {missed}x" for name, used, missed in stats
           if used != 1 or missed]
    if odd:
        return "its forward does not call its projections once each on its input (" + "; ".join(odd) + ")"
    if not isinstance(whole, torch.Tensor) or whole.shape != tiled.shape:
        return "its output is no tensor of the untiled shape when tiled"
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(whole):  # the memory simulator: shapes only, the stand-ins were checked
        return None
    tol = 1e-6 if whole.dtype == torch.float64 else 1e-4 if whole.dtype == torch.float32 else 2e-2
    scale = float(whole.abs().nan_to_num(0.0, 0.0, 0.0).max())  # NaN rows (eager attention, a fully masked row)
    if not torch.allclose(whole, tiled, rtol=tol, atol=tol * scale, equal_nan=True):
        return "tiled and untiled outputs differ"
    return None


def _verdict(attn: torch.nn.Module, original_forward: Callable, args: tuple, kwargs: dict) -> str | None:
    cls = type(attn)
    if cls not in _verdicts:
        reason = _structure_problem(attn) or _probe(attn, original_forward, args, kwargs)
        hidden = _hidden(args, kwargs)
        if reason is None and hidden.numel() // hidden.shape[-1] < 2:
            return "undecided"
        _verdicts[cls] = reason
        if reason is None:
            log_rank0_once("tiled-attn-class-" + cls.__qualname__, logging.INFO,
                           "ddp_patches: tiled attention: %s.%s tiles (norm, q/k/v and o_proj in token shards)",
                           cls.__module__, cls.__qualname__)
        else:
            log_rank0_once("tiled-attn-class-" + cls.__qualname__, logging.INFO,
                           "ddp_patches: tiled attention: %s.%s runs untiled: %s", cls.__module__,
                           cls.__qualname__, reason)
    return _verdicts[cls]


def _structure_problem(attn: torch.nn.Module) -> str | None:
    children = _children(attn)  # its own: not what a wrapper's __getattr__ reaches inside
    missing = [n for n in _PROJ if not isinstance(children.get(n), torch.nn.Module)]
    return f"no {'/'.join(missing)} submodule" if missing else None


def _hook_problem(attn: torch.nn.Module, norm: torch.nn.Module | None) -> str | None:
    """A hook that would see a tiled call differently (tiled_mlp's NOTE [Hooks inside a tiled MLP]), or None. The
    norm runs inside every q/k/v shard, so its own hooks count too (checked at each call: a hook added late)."""
    why = _own_hook_problem(norm)
    if why is not None:
        return why
    for module in (attn, norm):
        if module is not None:
            why = tiled_mlp.rules.hook_problem(module, _params((module,)))
            if why is not None:
                return why
    return None


def _own_hook_problem(norm: torch.nn.Module | None) -> str | None:
    """A hook on the input norm itself, which would run once per shard; a hook marked ``observes_only`` (it reads
    nothing and changes nothing: the memory simulator's phase marker) may."""
    if norm is None:
        return None
    hooks = [*norm._forward_hooks.values(), *norm._forward_pre_hooks.values(), *norm._backward_hooks.values(),
             *norm._backward_pre_hooks.values()]
    if any(not getattr(hook, "observes_only", False) for hook in hooks):
        return "its input norm has a forward or backward hook (it would run once per shard)"
    return None


def _outside_problem(attn: torch.nn.Module, norm: torch.nn.Module | None, x: torch.Tensor) -> str | None:
    """Per instance, once: a trainable tensor from outside the shard's modules reaching a shard's output
    (the replay would not differentiate it: tiled_mlp's NOTE [Hooks inside a tiled MLP])."""
    if attn not in _outside:
        # Dropout off and the RNG restored: the check must not move the generator (a checkpoint's recompute, which
        # skips it, would draw other LoRA dropout masks than this forward: wrong gradients on the first step).
        devices = [x.device] if x.device.type == "cuda" else []
        with tiled_mlp.dropout_off(attn), torch.random.fork_rng(devices=devices, device_type="cuda"):
            _outside[attn] = _outside_check(attn, norm, x)
    return _outside[attn]


def _outside_check(attn: torch.nn.Module, norm: torch.nn.Module | None, x: torch.Tensor) -> str | None:
    """_outside_problem's check, run once per instance with dropout off and the RNG restored."""
    rows = x.detach().reshape(-1, x.shape[-1])[:2]
    why, q_width = None, None
    for name in _PROJ:
        modules = (_children(attn)["o_proj"],) if name == "o_proj" else _modules_of(attn, name, norm)
        holder = torch.nn.Module()
        holder._modules.update({str(i): m for i, m in enumerate(modules)})
        if name == "o_proj":
            fn, inp = _in_shard(modules[0]), torch.zeros(2, q_width, dtype=rows.dtype, device=rows.device)
        else:
            fn, inp = _projection(attn, name, norm), rows
        if name == "q_proj":
            with torch.no_grad():
                q_width = fn(rows).shape[-1]
        why = tiled_mlp.rules.outside_tensor(holder, inp, lambda _m, r, fn=fn: fn(r))
        if why is not None:
            why = f"{name}: {why}"
            break
    return why


def _declined(attn: torch.nn.Module, norm: torch.nn.Module | None, why: str) -> None:
    log_rank0_once(f"tiled-attn-{type(attn).__qualname__}-{why}", logging.WARNING,
                   "ddp_patches: tiled attention: %s runs untiled: %s (NOTE [The attention's own forward runs] in "
                   "ddp_patches/tiled_attention/call.py)", type(attn).__qualname__, why)


def _gate(module: torch.nn.Module, forced: bool) -> bool:
    """Whether this call may tile at all (before anything is looked at closely)."""
    if _inside["depth"] or not torch.is_grad_enabled() or tiled_mlp.rules.settings["untiled"]:
        return False
    if forced:
        return True
    if not _settings["on"] or not is_distributed() or engines.compiling():  # NOTE [Engines]
        return False
    engine = engines.of_module(module)
    if not engines.acts("tiled_attention", engine):
        engines.step_aside("tiled_attention", engine)
        return False
    return True


# NOTE [The other norms tiled]
# Invariant: the norms a decoder layer applies around its MLP (``post_attention_layernorm``, Gemma's
# ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``) and the decoder's final ``norm`` keep neither
# their float32 intermediates nor their gradients for the whole sequence: untiled, an RMSNorm's backward holds
# six float32 S x H tensors (12 bf16 S x H units: the peak of a tiled layer's backward, then of the head's).
# Tiled, each saves only its input and works one shard at a time.
# Rule: such a norm, with an attention beside it (the last layer's for the final norm) that tiles, runs through
# ``apply_tiled`` in the attention's shards once its class proved row-wise (4 rows whole and split in two agree);
# otherwise untiled. The value and every gradient are the untiled ones (row by row).
# Test: tests/test_tiled_attention.py::test_the_other_norms_are_tiled.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
def _not_rowwise(norm: torch.nn.Module, x: torch.Tensor, original_forward: Callable) -> bool:
    cls = type(norm)
    if cls not in _rowwise:
        _rowwise[cls] = _rowwise_probe(norm, x, original_forward)
        if _rowwise[cls] is not None:
            log_rank0_once("tiled-attn-norm-" + cls.__qualname__, logging.INFO,
                           "ddp_patches: tiled attention: the norm %s runs untiled: %s", cls.__qualname__,
                           _rowwise[cls])
    return _rowwise[cls] is not None


def _rowwise_probe(norm: torch.nn.Module, x: torch.Tensor, original_forward: Callable) -> str | None:
    from torch._subclasses.fake_tensor import is_fake

    rows = x.detach().reshape(-1, x.shape[-1])[:4]
    try:
        with torch.no_grad():
            whole = original_forward(norm, rows)
            parts = torch.cat([original_forward(norm, rows[:2]), original_forward(norm, rows[2:])])
    except Exception as exc:  # noqa: BLE001 - a norm that needs [batch, seq, H]
        return f"its forward fails on 2-D [tokens, H] rows ({type(exc).__name__}: {str(exc)[:120]})"
    if whole.shape != rows.shape:
        return f"maps [4, {rows.shape[-1]}] to {list(whole.shape)}, not to the same shape"
    if is_fake(whole):  # the memory simulator: shapes only
        return None
    tol = 1e-6 if whole.dtype == torch.float64 else 1e-4 if whole.dtype == torch.float32 else 2e-2
    if not torch.allclose(whole, parts, rtol=tol, atol=tol * float(whole.abs().max())):
        return "its output for a token depends on the other tokens of the call"
    return None
