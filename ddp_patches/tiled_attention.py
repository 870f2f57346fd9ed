"""The projections around Hugging Face attention run tiled along the token dimension, DDP-safe (opt-in).

``install(shard_tokens=...)`` and ``discover(model)`` patch the ``forward`` of the attention classes found by
structure (NOTE [Attention found by structure]) and of the norm each decoder layer applies before one
(``input_layernorm``). Under DDP, FSDP2 or DeepSpeed ZeRO-1/2 with grad enabled, a call runs the input norm, the
q/k/v projections (LoRA included, and q/k norms) and o_proj in token shards through the tiled MLP's machinery
(``tiled_mlp.apply_tiled``: no_grad shards, each replayed in backward, parameter gradients summed and given once),
while the class's own forward runs RoPE and the attention kernel on the whole sequence
(NOTE [The attention's own forward runs]). The norm before the MLP and the decoder's final norm run in token
shards alone (NOTE [The other norms tiled]). ``tile_model(model)`` tiles one model's attention in any process (the
memory simulator, single-process checks); ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import engines, tiled_mlp
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
# For NOTE [Attention tiled by bytes]: the automatic shard count.
AUTO_SHARDS = 4

_settings: dict = {"on": False, "shard_tokens": None}
_verdicts: dict[type, str | None] = {}  # attention class -> None (tiles) or why not; decided at its first call
_counts = {"tiled_calls": 0, "shards": 0}
_norms: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()  # norm->attn
_outside: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()
_normed = WeakIdKeyDictionary()  # a tiled input norm's output -> (norm, its input): NOTE [The input norm inside]
_inside = {"depth": 0}  # > 0 inside a shard: the patched forwards pass through
# For NOTE [The other norms tiled]: the layer's norms around its MLP, by name (and the decoder's final ``norm``)
_MLP_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_mlp_norms: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()  # ->attn
_rowwise: dict[type, str | None] = {}  # norm class -> None (row by row) or why not; its first tiled call


def counts() -> dict:
    """How many attention calls ran tiled, and in how many shards in all, since apply() (for logs and tests)."""
    return dict(_counts)


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


# NOTE [The attention's own forward runs]
# Invariant: a tiled attention computes what its class computes, for every family, with nothing re-implemented:
# RoPE (1-D or multimodal), q/k/v biases, GQA, sliding windows, softcapping and the kernel (eager, SDPA, flash via
# ALL_ATTENTION_FUNCTIONS) are the class's own forward, run on the whole sequence.
# Rule: q/k/v (through the layer's input norm, and q_norm/k_norm where the class has them) are computed first, by
# one ``tiled_mlp.apply_tiled`` over token shards (saving only its input; one node, so the norm's backward sees
# dq+dk+dv summed, as untiled; v copied out, so q and k before RoPE are not kept with it), then the class's
# forward runs with its q/k/v_proj (and q/k_norm) answering with those tensors for exactly the input they were
# made from, and o_proj running tiled on whatever it is given. A class is tiled after one probe at its first call
# (no_grad, dropout off: tiled and untiled outputs agree, and each stand-in was used once as expected); else it runs
# untiled with one log line saying why. A stand-in called otherwise later runs the real module.
# Test: tests/test_tiled_attention.py::test_single_process_parity.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
class _Given:
    """Stands in for a projection inside the class's forward: ``value`` for ``expect`` (once), else the real
    module. As q_norm/k_norm's stand-in, ``expect`` is the projection's stand-in output, viewed per head."""

    def __init__(self, real: torch.nn.Module, expect: torch.Tensor | None, value: torch.Tensor | None):
        self.real, self.expect, self.value = real, expect, value
        self.used, self.missed = 0, 0

    def _matches(self, x: torch.Tensor) -> bool:
        if self.expect is None or self.used or not isinstance(x, torch.Tensor):
            return False
        if x is self.expect:
            return True
        # q_norm's input: the projection's output viewed per head (its last dim split)
        e = self.expect
        return (x.data_ptr() == e.data_ptr() and x.numel() == e.numel() and x.dim() == e.dim() + 1
                and x.shape[:-2] == e.shape[:-1] and x.stride()[:-2] == e.stride()[:-1] and x.stride(-1) == 1
                and x.stride(-2) == x.shape[-1])

    def __call__(self, x, *args, **kwargs):
        if not args and not kwargs and self._matches(x):
            self.used += 1
            return self.value.view(x.shape) if self.value.shape != x.shape and self.expect is not x else self.value
        self.missed += 1
        return self.real(x, *args, **kwargs)


class _TiledO:
    """o_proj's stand-in: o_proj over token shards (once: a second call runs the real module)."""

    def __init__(self, real: torch.nn.Module, sizes: list[int]):
        self.real, self.sizes, self.used, self.missed = real, sizes, 0, 0

    def __call__(self, x, *args, **kwargs):
        if args or kwargs or self.used or not isinstance(x, torch.Tensor) \
                or x.numel() // max(x.shape[-1], 1) != sum(self.sizes):
            self.missed += 1
            return self.real(x, *args, **kwargs)
        self.used += 1
        params = tuple(p for p in self.real.parameters() if p.requires_grad)
        base = _frozen_base(self.real)

        def run(shard: torch.Tensor) -> torch.Tensor:
            with _replayed_without_matmul((base,) if base is not None else ()):
                return self.real(shard)

        out = tiled_mlp.apply_tiled(_in_shard(run), self.sizes, x.reshape(-1, x.shape[-1]), params,
                                    module=self.real)
        return out.view(*x.shape[:-1], out.shape[-1])


def _in_shard(fn: Callable) -> Callable:
    def run(shard: torch.Tensor) -> torch.Tensor:
        _inside["depth"] += 1
        try:
            return fn(shard)
        finally:
            _inside["depth"] -= 1
    return run


# NOTE [The replay skips the frozen matmul]
# Invariant: under checkpointing a tiled projection's frozen base matmul runs as often per step as untiled (in the
# forward and in the recompute); the backward's replay of a shard differentiates it without computing it again.
# Rule: in the replay (grad on), a projection that is a plain ``nn.Linear`` with a frozen weight, or PEFT's vanilla
# LoRA ``Linear`` around one (no DoRA or other variant), and whose output no q/k norm reads, runs that base as
# ``_FrozenLinear``: an uninitialised output of the linear's shape whose backward is the linear's (dx = g W, a
# bias's sum). Its value only meets the LoRA term's sum, a dtype cast and the shards' concatenation, whose
# backwards read no value, so every gradient is the real matmul's. Under autocast, or where x and W differ in
# dtype, the real linear runs. o_proj's replay does the same.
# Test: tests/test_tiled_attention.py::test_projection_forwards_under_checkpointing.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
class _FrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``'s graph without its value (NOTE [The replay skips the frozen matmul])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(weight)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, db


def _frozen_base(proj: torch.nn.Module) -> torch.nn.Linear | None:
    """The frozen ``nn.Linear`` whose value ``proj``'s output needs not, or None.
    NOTE [The replay skips the frozen matmul]"""
    base = proj
    if type(proj).__name__ == "Linear" and type(proj).__module__ == "peft.tuners.lora.layer":
        if getattr(proj, "lora_variant", None) or any(getattr(proj, "use_dora", {}).values()):
            return None
        base = _children(proj).get("base_layer")
    if type(base) is not torch.nn.Linear or base.weight.requires_grad or "forward" in vars(base):
        return None
    return base


@contextlib.contextmanager
def _replayed_without_matmul(bases: tuple):
    """Inside a shard's replay: each base in ``bases`` runs as ``_FrozenLinear``; a no-op in the no_grad
    forward, under autocast, or for an input of another dtype. NOTE [The replay skips the frozen matmul]"""
    patched = []
    if torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and not (
            torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        for base in bases:
            def forward(x, *args, _base=base, **kwargs):
                if args or kwargs or x.dtype != _base.weight.dtype:
                    return type(_base).forward(_base, x, *args, **kwargs)
                return _FrozenLinear.apply(x, _base.weight, _base.bias)
            vars(base)["forward"] = forward
            patched.append(base)
    try:
        yield
    finally:
        for base in patched:
            vars(base).pop("forward", None)


def _children(attn: torch.nn.Module) -> dict:
    return vars(attn).get("_modules") or {}


def _projection(attn: torch.nn.Module, name: str, norm: torch.nn.Module | None, inside: bool = True) -> Callable:
    """One shard's q, k or v: the input norm (when fused and ``inside``), the projection, its q/k norm where the
    class has one."""
    proj = _children(attn)[name]
    qk_norm = _children(attn).get(name[0] + "_norm") if name in ("q_proj", "k_proj") else None
    head_dim = getattr(attn, "head_dim", None)

    def run(shard: torch.Tensor) -> torch.Tensor:
        h = norm(shard) if norm is not None and inside else shard
        out = proj(h)
        if qk_norm is not None:
            per_head = isinstance(head_dim, int) and out.shape[-1] != head_dim and out.shape[-1] % head_dim == 0 \
                and getattr(getattr(qk_norm, "weight", None), "numel", lambda: -1)() == head_dim
            out = qk_norm(out.view(*out.shape[:-1], -1, head_dim)).reshape(out.shape) if per_head else qk_norm(out)
        return out

    return _in_shard(run) if inside else run


def _modules_of(attn: torch.nn.Module, name: str, norm: torch.nn.Module | None) -> tuple:
    mods = [_children(attn)[name]]
    if name in ("q_proj", "k_proj") and _children(attn).get(name[0] + "_norm") is not None:
        mods.append(_children(attn)[name[0] + "_norm"])
    return tuple(mods) + ((norm,) if norm is not None else ())


def _params(modules: tuple) -> tuple:
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return tuple(seen.values())


def _hidden(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("hidden_states")


def _tiled_call(attn: torch.nn.Module, original_forward: Callable, args: tuple, kwargs: dict,
                sizes_for: Callable[[int, int], list[int]], *, stats: list | None = None):
    """The class's forward with the projections tiled (NOTE [The attention's own forward runs])."""
    hidden = _hidden(args, kwargs)
    norm, source = _normed.get(hidden, (None, hidden))
    width = source.shape[-1]
    rows = source.numel() // width
    sizes = sizes_for(rows, width)
    if len(sizes) < 2:
        return original_forward(attn, *args, **kwargs)
    x2d = source.reshape(rows, width)
    given, lead, widths = {}, hidden.shape[:-1], []
    runs = [_projection(attn, name, norm, inside=False) for name in _PROJ[:3]]

    bases = tuple(b for name in _PROJ[:3] if _children(attn).get(name[0] + "_norm") is None or name == "v_proj"
                  for b in [_frozen_base(_children(attn)[name])] if b is not None)

    def qkv(shard: torch.Tensor) -> torch.Tensor:  # one Function: the norm's backward runs once, on dq+dk+dv
        h = norm(shard) if norm is not None else shard
        with _replayed_without_matmul(bases):
            outs = [run(h) for run in runs]
        widths[:] = [o.shape[-1] for o in outs]
        return torch.cat(outs, -1)

    modules = tuple(dict.fromkeys(m for name in _PROJ[:3] for m in _modules_of(attn, name, norm)))
    out = tiled_mlp.apply_tiled(_in_shard(qkv), sizes, x2d, _params(modules), module=modules)
    q, k, v = out.view(*lead, out.shape[-1]).split(widths, -1)
    # v is copied: the kernel saves v, and a view would keep q and k before RoPE alive with it
    for name, value in zip(_PROJ[:3], (q, k, v.clone())):
        given[name] = _Given(_children(attn)[name], hidden, value)
        qk = _children(attn).get(name[0] + "_norm") if name in ("q_proj", "k_proj") else None
        if qk is not None:
            given[name[0] + "_norm"] = _Given(qk, value, value)
    given["o_proj"] = _TiledO(_children(attn)["o_proj"], sizes)
    own = vars(attn)
    for name, stand_in in given.items():
        own[name] = stand_in  # found before nn.Module.__getattr__ looks in _modules
    try:
        result = original_forward(attn, *args, **kwargs)
    finally:
        for name in given:
            own.pop(name, None)
    if stats is not None:  # the probe's call: not counted
        stats.extend((name, s.used, s.missed) for name, s in given.items())
    else:
        _counts["tiled_calls"] += 1
        _counts["shards"] += len(sizes)
    return result


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
            why = tiled_mlp.rules._hook_problem(module, _params((module,)))
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
        why = tiled_mlp.rules._outside_tensor(holder, inp, lambda _m, r, fn=fn: fn(r))
        if why is not None:
            why = f"{name}: {why}"
            break
    return why


def _declined(attn: torch.nn.Module, norm: torch.nn.Module | None, why: str) -> None:
    log_rank0_once(f"tiled-attn-{type(attn).__qualname__}-{why}", logging.WARNING,
                   "ddp_patches: tiled attention: %s runs untiled: %s (NOTE [The attention's own forward runs] in "
                   "ddp_patches/tiled_attention.py)", type(attn).__qualname__, why)


def _sizes_for(shard_tokens: int | None) -> Callable[[int, int], list[int]]:
    return lambda rows, hidden: shard_sizes(rows, hidden, shard_tokens)


def _gate(module: torch.nn.Module, forced: bool) -> bool:
    """Whether this call may tile at all (before anything is looked at closely)."""
    if _inside["depth"] or not torch.is_grad_enabled() or tiled_mlp.rules._settings["untiled"]:
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


def _attention_forward(attn, original_forward: Callable, args: tuple, kwargs: dict, forced: bool,
                       shard_tokens: int | None):
    hidden = _hidden(args, kwargs)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or not _gate(attn, forced) \
            or kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
        return original_forward(attn, *args, **kwargs)  # a KV cache: generation, not training
    norm = _normed.get(hidden, (None, None))[0]
    source = _normed.get(hidden, (None, hidden))[1]
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    if len(shard_sizes(rows, source.shape[-1], shard_tokens)) < 2:
        return original_forward(attn, *args, **kwargs)
    why = _hook_problem(attn, norm) or (tiled_mlp.rules._cached_parametrization(attn) and "a cached parametrization")
    if why:
        _declined(attn, norm, why)
        return original_forward(attn, *args, **kwargs)
    if _verdict(attn, original_forward, args, kwargs) is not None:
        return original_forward(attn, *args, **kwargs)
    why = _outside_problem(attn, norm, source)
    if why:
        _declined(attn, norm, why)
        return original_forward(attn, *args, **kwargs)
    return _tiled_call(attn, original_forward, args, kwargs, _sizes_for(shard_tokens))


# NOTE [The input norm inside]
# Invariant: the decoder layer's input norm (``input_layernorm``, beside the attention) runs in the q/k/v shards,
# so neither its float32 intermediates nor its output are kept for backward; the layer still gets a correct,
# differentiable output from it (a parallel block's MLP reads it too).
# Rule: the norm's own call runs tiled (``apply_tiled``: its output saves only its input) and records
# output -> (norm, input); the attention, called on that very tensor, projects from the input through the norm in
# each shard. Where nothing else reads the norm's output, its tiled node is never reached in backward; where
# something does, that node gives its gradient, and a trainable norm weight gets one summed gradient.
# Test: tests/test_tiled_attention.py::test_single_process_parity.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
def _norm_forward(norm, original_forward: Callable, args: tuple, kwargs: dict, forced: bool,
                  shard_tokens: int | None):
    attn = _norms.get(norm)
    before_mlp = attn is None
    attn = _mlp_norms.get(norm) if before_mlp else attn
    x = args[0] if len(args) == 1 and not kwargs else None
    if attn is None or not isinstance(x, torch.Tensor) or x.dim() < 2 or not _gate(norm, forced) \
            or _verdicts.get(type(attn), None) is not None:
        return original_forward(norm, *args, **kwargs)
    width = x.shape[-1]
    rows = x.numel() // max(width, 1)
    sizes = shard_sizes(rows, width, shard_tokens)
    if len(sizes) < 2 or tiled_mlp.rules._hook_problem(norm, ()) is not None or _own_hook_problem(norm) is not None \
            or (before_mlp and _not_rowwise(norm, x, original_forward)):
        return original_forward(norm, *args, **kwargs)
    run = _in_shard(lambda shard: original_forward(norm, shard))
    y = tiled_mlp.apply_tiled(run, sizes, x.reshape(rows, width), _params((norm,)), module=norm)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if not before_mlp:
        _normed[y] = (norm, x)
    return y


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


def _layers(model: torch.nn.Module):
    """(attention, its input norm or None) for every attention in ``model`` (NOTE [Attention found by structure])."""
    found = {}
    for module in model.modules():
        children = _children(module)
        attn = children.get("self_attn")
        if isinstance(attn, torch.nn.Module) and _structure_problem(attn) is None:
            norm = children.get("input_layernorm")
            found[attn] = norm if isinstance(norm, torch.nn.Module) else None
            for name in _MLP_NORMS:
                other = children.get(name)
                if isinstance(other, torch.nn.Module):
                    _mlp_norms[other] = attn
    for module in model.modules():
        if module not in found and _structure_problem(module) is None:
            found[module] = None
    for module in model.modules():  # the decoder's final norm, beside its layers: by the last layer's attention
        final = _children(module).get("norm")
        layers = [m for m in _children(module).values() if isinstance(m, torch.nn.ModuleList)]
        attns = [_children(layer).get("self_attn") for mods in layers for layer in mods]
        if isinstance(final, torch.nn.Module) and attns and attns[-1] in found:
            _mlp_norms[final] = attns[-1]
    return found


# NOTE [Attention found by structure]
# Invariant: an attention module is tiled only if it owns q_proj, k_proj, v_proj and o_proj (its own children, as
# the tiled MLP's gate/up/down) and its class passed the probe of NOTE [The attention's own forward runs]; its
# input norm only if the layer that owns it names it ``input_layernorm`` beside it as ``self_attn``. There is no
# list of families. A module named ``self_attn`` without the four (a fused qkv_proj) is logged once and left alone.
# Test: tests/test_tiled_attention.py::test_unknown_attention_runs_untiled.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
def discover(model: torch.nn.Module) -> list[str]:
    """Patch the forward of every attention class (and its input norm's class) in ``model``. Called for you where
    the tiled MLP's discovery runs (a transformers model built after apply(), a DDP built)."""
    if not _settings["on"]:
        return []
    found = []
    for attn, norm in _layers(model).items():
        _norms_pair(attn, norm)
        for cls in (type(attn), type(norm) if norm is not None else None, *map(type, _mlp_norms_of(attn))):
            if cls is not None and _patch_class(cls, _attention_forward if cls is type(attn) else _norm_forward):
                found.append(f"{cls.__module__}.{cls.__qualname__}")
    for module in model.modules():
        attn = _children(module).get("self_attn")
        if isinstance(attn, torch.nn.Module) and _structure_problem(attn) is not None:
            log_rank0_once("tiled-attn-unknown-" + type(attn).__qualname__, logging.INFO,
                           "ddp_patches: tiled attention: %s runs untiled: %s", type(attn).__qualname__,
                           _structure_problem(attn))
    if found:
        log_rank0_once("tiled-attn-found-" + ",".join(sorted(found)), logging.INFO,
                       "ddp_patches: tiled attention: classes patched on %s: %s", type(model).__qualname__,
                       ", ".join(sorted(found)))
    return found


def _mlp_norms_of(attn: torch.nn.Module) -> list:
    return [norm for norm, owner in list(_mlp_norms.items()) if owner is attn]


def _norms_pair(attn: torch.nn.Module, norm: torch.nn.Module | None) -> None:
    if norm is not None:
        _norms[norm] = attn


def _patch_class(cls: type, body: Callable) -> bool:
    owner = tiled_mlp.patch._forward_owner(cls)
    if owner is None or REGISTRY.is_patched(owner, "forward"):
        return False

    def make(original_forward: Callable) -> Callable:
        def forward(self, *args, **kwargs):
            return body(self, original_forward, args, kwargs, False, _settings["shard_tokens"])
        return forward

    REGISTRY.install(owner, "forward", make)
    return True


@contextlib.contextmanager
def tile_model(model: torch.nn.Module, shard_tokens: int | None = None):
    """Inside this block, every attention of ``model`` (and its input norm) runs tiled in any process, with
    ``shard_tokens`` tokens per shard or the rule of NOTE [Attention tiled by bytes]: what the memory simulator
    and single-process checks run. Instance attributes, removed on exit; nothing global is patched."""
    patched = []
    for attn, norm in _layers(model).items():
        _norms_pair(attn, norm)
        for module, body in ((attn, _attention_forward), (norm, _norm_forward),
                             *((other, _norm_forward) for other in _mlp_norms_of(attn))):
            if module is None or "forward" in vars(module):
                continue
            original = type(module).forward
            if REGISTRY.is_patched(tiled_mlp.patch._forward_owner(type(module)) or type(module), "forward"):
                original = REGISTRY.original(tiled_mlp.patch._forward_owner(type(module)), "forward")
            module.forward = lambda *a, _m=module, _o=original, _b=body, **k: _b(_m, _o, a, k, True, shard_tokens)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            vars(module).pop("forward", None)


def enabled() -> bool:
    return _settings["on"]


def install(*, shard_tokens: int | None) -> list[str]:
    """Patch the attention classes imported so far that models are built with, and discover the rest as models
    are built or wrapped (NOTE [Attention found by structure])."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "ddp_patches: apply(tiled_attention=True) tiles the attention of transformers models, and needs "
            f"transformers (importing it failed: {exc}). Install it (pip install 'ddp_patches[hf]'), or leave "
            "tiled_attention off") from exc
    _settings.update(on=True, shard_tokens=shard_tokens)
    _counts.update(tiled_calls=0, shards=0)
    _verdicts.clear()
    _rowwise.clear()
    _outside.clear()
    if discover not in tiled_mlp.patch._also_discover:
        tiled_mlp.patch._also_discover.append(discover)
    return tiled_mlp.install_discovery()
