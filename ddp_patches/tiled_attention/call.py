"""One tiled attention call: the projections in token shards around the class's own forward.

``_tiled_call`` computes q/k/v (through the layer's input norm, and q/k norms) in one ``tiled_mlp.apply_tiled``
over token shards, then runs the class's forward with stand-ins that answer with those tensors and run o_proj
tiled (NOTE [The attention's own forward runs]); in the backward's replay a frozen base matmul is not computed
again (NOTE [The replay skips the frozen matmul]). ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import tiled_mlp

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_counts = {"tiled_calls": 0, "shards": 0}
_normed = WeakIdKeyDictionary()  # a tiled input norm's output -> (norm, its input): NOTE [The input norm inside]
_inside = {"depth": 0}  # > 0 inside a shard: the patched forwards pass through


def counts() -> dict:
    """How many attention calls ran tiled, and in how many shards in all, since apply() (for logs and tests)."""
    return dict(_counts)


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
# untiled with one log line saying why; a later call that goes otherwise:
# NOTE [A call unlike the probe runs again untiled].
# Test: tests/test_tiled_attention.py::test_single_process_parity.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
class _Given:
    """Stands in for a projection inside the class's forward: ``value`` for ``expect`` (once), else the real
    module. As q_norm/k_norm's stand-in, ``expect`` is the projection's stand-in output, viewed per head."""

    def __init__(self, real: torch.nn.Module, expect: torch.Tensor | None, value: torch.Tensor | None,
                 normed: int | None = None):
        self.real, self.expect, self.value, self.normed = real, expect, value, normed  # normed: the norm's width
        self.used, self.missed = 0, 0

    def _matches(self, x: torch.Tensor) -> bool:
        if self.expect is None or self.used or not isinstance(x, torch.Tensor):
            return False
        if self.normed is not None and x.shape[-1] != self.normed:
            return False  # a norm over other groups than the shards normed
        if x is self.expect:
            return True
        # q_norm's input: the projection's output viewed per head (its last dim split), heads moved or not
        e = self.expect
        return (self.value is e and x.data_ptr() == e.data_ptr() and x.numel() == e.numel()
                and x.dim() == e.dim() + 1 and x.stride(-1) == 1 and x.shape[-1] > 0 and e.shape[-1] % x.shape[-1] == 0
                and _dims(x) == _dims(e.view(*e.shape[:-1], -1, x.shape[-1])))

    def __call__(self, x, *args, **kwargs):
        if not args and not kwargs and self._matches(x):
            self.used += 1
            return self.value if x is self.expect else x.view(x.shape)  # a view of value: already normed per head
        self.missed += 1
        return self.real(x, *args, **kwargs)


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """A view's (size, stride) pairs in any order: two views of one storage that list the same pairs hold the same
    elements, each row of the last dim the same contiguous run (a transpose of the heads keeps them)."""
    return sorted((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1)


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
            width = _normed_width(qk_norm, head_dim, out.shape[-1])
            out = qk_norm(out.view(*out.shape[:-1], -1, width)).reshape(out.shape) if width != out.shape[-1] \
                else qk_norm(out)
        return out

    return _in_shard(run) if inside else run


def _normed_width(qk_norm: torch.nn.Module, head_dim, width: int) -> int:
    """The groups a q/k norm runs over in the shards: per head where its weight is one head's, else the width."""
    per_head = isinstance(head_dim, int) and width != head_dim and head_dim > 0 and width % head_dim == 0 \
        and getattr(getattr(qk_norm, "weight", None), "numel", lambda: -1)() == head_dim
    return head_dim if per_head else width


class UnlikeTheProbe(RuntimeError):
    """A tiled call whose stand-ins were not each used once as at the probe: its result is not trusted
    (NOTE [A call unlike the probe runs again untiled])."""


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
            given[name[0] + "_norm"] = _Given(qk, value, value, _normed_width(qk, getattr(attn, "head_dim", None),
                                                                              value.shape[-1]))
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
        return result
    odd = [f"{name} used {s.used}x, called otherwise {s.missed}x" for name, s in given.items()
           if s.used != 1 or s.missed]
    if odd:
        raise UnlikeTheProbe("a call did not use its projections once each as its first did (" + "; ".join(odd) + ")")
    _counts["tiled_calls"] += 1
    _counts["shards"] += len(sizes)
    return result
