"""The tiled attention's patches: the patched ``forward`` of attention and norm classes, discovery, install.

``install(shard_tokens=...)`` patches the attention classes found by structure and the norms beside them
(NOTE [Attention found by structure]), and registers ``discover`` with the tiled MLP's discovery (a transformers
model built, a DDP built). The input norm runs inside the q/k/v shards (NOTE [The input norm inside]).
``tile_model(model)`` tiles one model's attention in any process (the memory simulator, single-process checks).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable

import torch

from .. import tiled_mlp
from .._registry import REGISTRY
from ..distributed import log_rank0_once
from .call import UnlikeTheProbe, _children, _counts, _hidden, _in_shard, _normed, _params, _tiled_call
from .rules import (_declined, _gate, _hook_problem, _not_rowwise, _outside, _outside_problem, _own_hook_problem,
                    _rowwise, _settings, _structure_problem, _verdict, _verdicts, shard_sizes)

_norms: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()  # norm->attn

# For NOTE [The other norms tiled]: the layer's norms around its MLP, by name (and the decoder's final ``norm``)
_MLP_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_mlp_norms: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()  # ->attn


def _sizes_for(shard_tokens: int | None) -> Callable[[int, int], list[int]]:
    return lambda rows, hidden: shard_sizes(rows, hidden, shard_tokens)


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
    why = _hook_problem(attn, norm) or (tiled_mlp.rules.cached_parametrization(attn) and "a cached parametrization")
    if why:
        _declined(attn, norm, why)
        return original_forward(attn, *args, **kwargs)
    if _verdict(attn, original_forward, args, kwargs) is not None:
        return original_forward(attn, *args, **kwargs)
    why = _outside_problem(attn, norm, source)
    if why:
        _declined(attn, norm, why)
        return original_forward(attn, *args, **kwargs)
    return _tiled_or_again_untiled(attn, norm, original_forward, args, kwargs, shard_tokens)


# NOTE [A call unlike the probe runs again untiled]
# Invariant: a class that passed its probe (NOTE [The attention's own forward runs]) but whose later call goes
# another way (a training-only path the no_grad, eval-mode probe did not take; another instance of the class with
# another q/k norm; an in-place edit that autograd refuses on the shards' views) never returns a tiled result that
# may differ from the untiled one, and never raises where untiled would not.
# Rule: a tiled call whose stand-ins were not each used once, or whose forward raised, is discarded, the random
# generators put back where they were before it, and the call runs untiled, with one WARNING saying why. The
# verdict is per call, not kept: a checkpoint's recompute makes the same attempt and goes the way its forward went.
# Test: tests/test_tiled_attention.py::test_a_call_unlike_the_probe_runs_again_untiled.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12.1
def _tiled_or_again_untiled(attn, norm, original_forward: Callable, args: tuple, kwargs: dict,
                            shard_tokens: int | None):
    device = _hidden(args, kwargs).device
    devices = [device] if device.type == "cuda" else []
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    try:
        return _tiled_call(attn, original_forward, args, kwargs, _sizes_for(shard_tokens))
    except Exception as exc:  # noqa: BLE001 - untiled decides: it raises where torch would
        why = str(exc) if isinstance(exc, UnlikeTheProbe) else \
            f"its forward raised when tiled ({type(exc).__name__}: {str(exc)[:160]})"
    _declined(attn, norm, why + "; each such call runs tiled, then again untiled")
    torch.set_rng_state(cpu_state)
    for d, state in zip(devices, cuda_states):
        torch.cuda.set_rng_state(state, d)
    return original_forward(attn, *args, **kwargs)


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
    if len(sizes) < 2 or tiled_mlp.rules.hook_problem(norm, ()) is not None or _own_hook_problem(norm) is not None \
            or (before_mlp and _not_rowwise(norm, x, original_forward)):
        return original_forward(norm, *args, **kwargs)
    run = _in_shard(lambda shard: original_forward(norm, shard))
    y = tiled_mlp.apply_tiled(run, sizes, x.reshape(rows, width), _params((norm,)), module=norm)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if not before_mlp:
        _normed[y] = (norm, x)
    return y


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
    owner = tiled_mlp.patch.forward_owner(cls)
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
            if REGISTRY.is_patched(tiled_mlp.patch.forward_owner(type(module)) or type(module), "forward"):
                original = REGISTRY.original(tiled_mlp.patch.forward_owner(type(module)), "forward")
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
    if discover not in tiled_mlp.patch.also_discover:
        tiled_mlp.patch.also_discover.append(discover)
    return tiled_mlp.install_discovery()
