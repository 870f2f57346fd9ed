"""Whether a tiled-MLP call tiles, and in how many shards.

``shard_sizes`` / ``auto_shards`` give the shards (NOTE [Tiling by bytes]). A class tiles once it is a gated MLP by
structure and its probe proved it token-wise (NOTE [MLPs found by structure]); a call runs untiled where hooks, a
cached parametrization or a trainable tensor from outside the MLP would see the shards
(NOTE [Hooks inside a tiled MLP]). ``untiled()`` runs patched MLPs untiled inside a block. The settings
``install()`` sets, and the verdicts it clears, live here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Callable

import torch
from torch.nn.utils import parametrize

from ..distributed import log_rank0_once

_GATED = ("gate_proj", "up_proj", "down_proj")
# For NOTE [Tiling by bytes]: what an untiled gated MLP keeps for its backward, per token, in [tokens,
# intermediate] tensors (measured with saved-tensor hooks on a LoRA'd LlamaMLP: 4.75 -- gate_proj's and up_proj's
# outputs, the activation's, their product, down_proj's input).
SAVED_PER_TOKEN = 5

settings: dict = {"shard_tokens": None, "untiled": 0, "mlp": False}  # mlp: apply(tiled_mlp=True)
_verdicts: dict[type, str | None] = {}  # class -> None (tiles) or why not; decided at its first call
_measured_intermediate: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
_outside: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()  # per instance


@contextlib.contextmanager
def untiled():
    """Run patched MLPs untiled inside this block (a reference computation, evaluation code)."""
    settings["untiled"] += 1
    try:
        yield
    finally:
        settings["untiled"] -= 1


def shard_sizes(rows: int, hidden: int, shard_tokens: int | None, intermediate: int | None = None) -> list[int]:
    """Rows per shard, evenly split: at most ``shard_tokens`` each, or, when None, as many shards as
    ``auto_shards`` decides from the bytes (NOTE [Tiling by bytes]; ``intermediate`` is then needed)."""
    if shard_tokens is not None:
        count = max(1, math.ceil(rows / shard_tokens))
    elif intermediate is None:
        raise TypeError("tiled_mlp.shard_sizes: the automatic rule (shard_tokens=None) decides by bytes and needs "
                        "intermediate= (the MLP's intermediate size, gate_proj's output features)")
    else:
        count = auto_shards(rows, hidden, intermediate)
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def auto_shards(rows: int, hidden: int, intermediate: int) -> int:
    """Shards for a call of ``rows`` tokens (1: untiled). NOTE [Tiling by bytes]."""
    if hidden <= 0 or intermediate <= 0:
        return 1
    need = math.ceil(SAVED_PER_TOKEN * intermediate / hidden)  # a shard's intermediates <= the call's hidden states
    most = rows // hidden  # no shard under hidden_size tokens: no finer than ALST
    count = min(need, most)
    return count if count >= 2 else 1


def _long_enough(rows: int, hidden: int) -> bool:
    """Could this call tile at all? (Before the probe and before I is read.)"""
    shard_tokens = settings["shard_tokens"]
    return rows > shard_tokens if shard_tokens is not None else rows // max(hidden, 1) >= 2


def _plan(module: torch.nn.Module, x: torch.Tensor, rows: int, hidden: int) -> list[int]:
    shard_tokens = settings["shard_tokens"]
    if shard_tokens is not None:
        return shard_sizes(rows, hidden, shard_tokens)
    return shard_sizes(rows, hidden, None, intermediate_width(module, x))


def cached_parametrization(module: torch.nn.Module) -> bool:
    """Whether a parametrized weight of ``module`` would be cached inside the no_grad tiled forward (or a probe)
    and the replay then read it without history; logs why (NOTE [The replay reads what the forward read]).
    Decided before the probes: under the cache they would fill it with a tensor without history."""
    if not getattr(parametrize, "_cache_enabled", 0) \
            or not any(parametrize.is_parametrized(m) for m in module.modules()):
        return False
    log_rank0_once(f"tiled-cached-{type(module).__qualname__}", logging.WARNING,
                   "ddp_patches: tiled MLP: %s runs untiled: a parametrized weight inside "
                   "torch.nn.utils.parametrize.cached() (NOTE [The replay reads what the forward read] in "
                   "ddp_patches/tiled_mlp/function.py)", type(module).__qualname__)
    return True


# NOTE [Hooks inside a tiled MLP]
# Invariant: a tiled MLP is exact or runs untiled. It runs its submodules once per shard in forward (under
# no_grad) and again in backward, and takes parameter gradients with ``autograd.grad`` per shard, so a forward or
# forward-pre hook on a submodule (or a global one) would fire twice per shard on outputs without history, and a
# tensor hook on a parameter would run once per shard and again on the sum.
# Rule: a call runs untiled, with one WARNING line on rank 0 naming the hook, whenever a submodule has forward,
# forward-pre or backward hooks, a global module hook is set, or a trainable parameter of the MLP has a tensor hook
# (read per call: a few dict lookups per submodule). Hooks on the MLP itself wrap the whole call and are kept. A
# trainable tensor that reaches the output from outside the MLP's own parameters (a tensor attribute, another
# module's parameter) is found per instance, at its first tiled call, by one forward of 2 rows with grad, and
# leaves that instance untiled.
# Test: tests/test_tiled_mlp_hooks.py::test_a_hooked_mlp_runs_untiled_with_exact_gradients.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
OUTSIDE = "a trainable tensor from outside its parameters"
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hooked(module: torch.nn.Module, params: tuple) -> bool:
    """Whether a hook would see this call differently tiled (NOTE [Hooks inside a tiled MLP]); logs why."""
    why = hook_problem(module, params)
    if why is not None:
        log_rank0_once(f"tiled-hook-{type(module).__qualname__}-{why}", logging.WARNING,
                       "ddp_patches: tiled MLP: %s runs untiled: %s (hooks there would fire once per shard; "
                       "NOTE [Hooks inside a tiled MLP] in ddp_patches/tiled_mlp/rules.py)", type(module).__qualname__,
                       why)
    return why is not None


def hook_problem(module: torch.nn.Module, params: tuple) -> str | None:
    from torch.nn.modules import module as module_mod

    for name in _GLOBAL_HOOKS:
        if getattr(module_mod, name, None):
            return f"a global module hook is set (torch.nn.modules.module.{name})"
    stack = list(module._modules.values())  # its submodules, without named_modules()'s name building (per call)
    while stack:
        sub = stack.pop()
        if sub is None:
            continue
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            name = next(n for n, m in module.named_modules() if m is sub)
            return f"its submodule '{name}' has a forward or backward hook"
        stack.extend(sub._modules.values())
    for p in params:
        if p._backward_hooks:
            return "a trainable parameter has a tensor hook (register_hook)"
    return None


# NOTE [Tiling by bytes]
# Invariant: the automatic rule tiles just enough that the MLP stops dominating the layer's working set, no finer,
# and reads only shapes, so every rank and every step of one length shard alike. Untiled, a gated MLP keeps about
# SAVED_PER_TOKEN [tokens, intermediate] tensors for its backward (17.5 hidden-state tensors' worth at I = 3.5 H)
# while the rest of a decoder layer keeps about 7; tiling costs a per-shard replay and matmuls on fewer rows.
# Rule: shards = min(ceil(SAVED_PER_TOKEN x I / H), rows // H), untiled below 2:
#   * the first term makes one shard's intermediates no larger than the call's hidden states, so the MLP adds
#     about one hidden-state tensor to the layer at every length; more shards could save at most that tensor;
#   * the second keeps shards at least hidden_size tokens (ALST's own shard size, so never finer than ALST),
#     where a shard's intermediates outweigh the gate/up/down weights its matmuls read.
# For Llama-8B (H 4096, I 14336): 2 shards at 8K tokens, 8 at 32K, 18 from 72K on. ``tiled_mlp_shard_tokens`` is
# the user's explicit choice and is always honoured.
# Test: tests/test_tiled_mlp.py::test_auto_rule_shards_by_bytes.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def intermediate_width(module: torch.nn.Module, x: torch.Tensor) -> int:
    """gate_proj's output features: ``out_features`` of an nn.Linear, a PEFT LoRA layer or a bitsandbytes layer;
    else measured once on one token (cached per module)."""
    gate = vars(module)["_modules"]["gate_proj"]
    features = getattr(gate, "out_features", None)
    if isinstance(features, int):
        return features
    if module not in _measured_intermediate:
        with torch.no_grad():
            _measured_intermediate[module] = gate(x.detach().reshape(-1, x.shape[-1])[:1]).shape[-1]
    return _measured_intermediate[module]


# NOTE [MLPs found by structure]
# Invariant: a class is tiled only if it is a gated MLP by structure and proven token-wise; there is no list of
# families. ``gate_proj``, ``up_proj`` and ``down_proj`` must be the instance's own children: a wrapper whose
# ``__getattr__`` reaches into what it wraps (PeftModel and LoraModel around a bare MLP, FSDP1, torch.compile's
# module) is no MLP, and patching its class would reach every instance of it.
# Rule: ``forward(x)`` mapping [..., H] -> [..., H] row by row is proven once per class, at its first distributed
# call, by a probe (4 rows through the original forward, whole and split in two, under no_grad, dropout off and a
# forked RNG, so it changes nothing); a class whose output has another shape or mixes tokens is left untiled and
# logged with the reason. Any other call (more arguments, keywords) runs the original forward. Candidates are
# found at apply() among the nn.Module classes already imported (their ``__init__`` assigns the three names), when
# a transformers model finishes ``post_init`` (FSDP2 and DeepSpeed never call DDP's __init__), and when DDP wraps
# a module.
# Test: tests/test_tiled_mlp.py::test_mlps_found_by_structure_and_probed.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def _verdict(module: torch.nn.Module, x: torch.Tensor, original_forward: Callable) -> str | None:
    cls = type(module)
    if cls not in _verdicts:
        reason = _structure_problem(module) or _probe(module, x, original_forward)
        _verdicts[cls] = reason
        if reason is None:
            log_rank0_once("tiled-class-" + cls.__qualname__, logging.INFO,
                           "ddp_patches: tiled MLP: %s.%s tiles (gate/up/down, token-wise [..., %d] -> [..., %d])",
                           cls.__module__, cls.__qualname__, x.shape[-1], x.shape[-1])
        else:  # a WARNING where tiling was possible and is declined for exactness: NOTE [Hooks inside a tiled MLP]
            log_rank0_once("tiled-class-" + cls.__qualname__,
                           logging.WARNING if reason.startswith(OUTSIDE) else logging.INFO,
                           "ddp_patches: tiled MLP: %s.%s is MLP-like but runs untiled: %s",
                           cls.__module__, cls.__qualname__, reason)
    return _verdicts[cls]


def _structure_problem(module: torch.nn.Module) -> str | None:
    children = vars(module).get("_modules") or {}  # its own: not what a wrapper's __getattr__ reaches inside
    missing = [n for n in _GATED if not isinstance(children.get(n), torch.nn.Module)]
    return f"no {'/'.join(missing)} submodule" if missing else None


def _probe(module: torch.nn.Module, x: torch.Tensor, original_forward: Callable) -> str | None:
    rows = x.detach().reshape(-1, x.shape[-1])[:4]
    if rows.shape[0] < 4:
        return None  # too few rows to tile anyway (never reached: tiling needs >= 2 shards)
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.no_grad(), dropout_off(module), torch.random.fork_rng(devices=devices, device_type="cuda"):
            whole = original_forward(module, rows)
            parts = torch.cat([original_forward(module, rows[:2]), original_forward(module, rows[2:])])
    except Exception as exc:  # noqa: BLE001 - e.g. a forward that needs [batch, seq, H]: tiles feed 2-D rows
        return f"its forward fails on 2-D [tokens, H] rows ({type(exc).__name__}: {str(exc)[:120]})"
    if whole.shape != rows.shape:
        return f"maps [4, {rows.shape[-1]}] to {list(whole.shape)}, not to the same shape"
    tol = 1e-4 if whole.dtype in (torch.float32, torch.float64) else 2e-2
    if not torch.allclose(whole, parts, rtol=tol, atol=tol * float(whole.abs().max())):
        return "its output for a token depends on the other tokens of the call (rows run in two parts differ)"
    return None


def _reaches_outside(module: torch.nn.Module, x: torch.Tensor, original_forward: Callable) -> bool:
    """Per instance, at its first tiled call: whether a trainable tensor from outside its parameters reaches its
    output (NOTE [Hooks inside a tiled MLP]); logs why, once per class and reason."""
    if module not in _outside:
        _outside[module] = outside_tensor(module, x.detach().reshape(-1, x.shape[-1])[:2], original_forward)
        if _outside[module] is not None:
            cls = type(module)
            log_rank0_once(f"tiled-outside-{cls.__qualname__}-{_outside[module]}", logging.WARNING,
                           "ddp_patches: tiled MLP: a %s.%s runs untiled: %s", cls.__module__, cls.__qualname__,
                           _outside[module])
    return _outside[module] is not None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def outside_tensor(module: torch.nn.Module, rows: torch.Tensor, original_forward: Callable) -> str | None:
    """A trainable tensor other than the MLP's own parameters that its output depends on (the tiled backward
    would not differentiate it: NOTE [Hooks inside a tiled MLP]); one small forward with grad, on 2 rows."""
    own = {id(p) for p in module.parameters()}
    # A parameter substituted for this call (``functional_call``'s ``w + e``) is the module's own: the walk stops at
    # it rather than take the ``w`` behind it for a tensor from outside
    # (NOTE [The replay reads what the forward read]).
    stops = {p.grad_fn for p in module.parameters() if p.grad_fn is not None}
    devices = [rows.device] if rows.device.type == "cuda" else []
    # Its own identity saved-tensor hooks: inside a checkpointed forward, the checkpoint's (or offload's) hooks must
    # not count what this probe saves (the recompute runs no probe).
    with torch.enable_grad(), dropout_off(module), torch.random.fork_rng(devices=devices, device_type="cuda"), \
            torch.autograd.graph.saved_tensors_hooks(_same, _same):
        out = original_forward(module, rows)
    seen, stack = set(), [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or node in stops:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in own:
            return f"{OUTSIDE} (shape {list(leaf.shape)}) reaches its output"
        stack.extend(fn for fn, _ in node.next_functions)
    return None


@contextlib.contextmanager
def dropout_off(module: torch.nn.Module):
    """Dropout off inside ``module`` (its masks depend on the call's shape), flags restored after: the module's
    own training flag (functional dropout reads it) and its dropout layers'. Nothing else: eval mode changes
    other layers' state (bitsandbytes repacks 4-bit weights for CPU inference)."""
    switched = [m for m in module.modules()
                if m.training and (m is module or isinstance(m, torch.nn.modules.dropout._DropoutNd))]
    for m in switched:
        m.training = False
    try:
        yield
    finally:
        for m in switched:
            m.training = True
