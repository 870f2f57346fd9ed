"""Hugging Face gated MLPs run tiled along the token dimension, with a DDP-safe backward (opt-in).

``install(shard_tokens=...)`` and ``discover(model)`` patch the ``forward`` of the classes found by structure
(NOTE [MLPs found by structure]). Under DDP, FSDP2 or DeepSpeed ZeRO-1/2 with grad enabled, a call is split into
the shards ``shard_sizes`` / ``auto_shards`` give (NOTE [Tiling by bytes]) and runs through ``apply_tiled``.
``untiled()`` runs patched MLPs untiled inside a block; ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import weakref
from typing import Callable

import torch
from torch.nn.utils import parametrize

from . import engines
from .rescue.edges import needs_defined_zero
from ._registry import REGISTRY
from .distributed import is_distributed, log_rank0_once

logger = logging.getLogger("ddp_patches")

_GATED = ("gate_proj", "up_proj", "down_proj")
# For NOTE [Tiling by bytes]: what an untiled gated MLP keeps for its backward, per token, in [tokens,
# intermediate] tensors (measured with saved-tensor hooks on a LoRA'd LlamaMLP: 4.75 -- gate_proj's and up_proj's
# outputs, the activation's, their product, down_proj's input).
SAVED_PER_TOKEN = 5

_settings: dict = {"shard_tokens": None, "untiled": 0, "mlp": False}  # mlp: apply(tiled_mlp=True)
_also_discover: list = []  # other tiled patches' discover(model), registered by their install()
_verdicts: dict[type, str | None] = {}  # class -> None (tiles) or why not; decided at its first call
_counts = {"tiled_calls": 0, "shards": 0}
_measured_intermediate: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
_outside: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()  # per instance


def counts() -> dict:
    """How many MLP calls ran tiled, and in how many shards in all, since apply() (for logs and tests)."""
    return dict(_counts)


@contextlib.contextmanager
def untiled():
    """Run patched MLPs untiled inside this block (a reference computation, evaluation code)."""
    _settings["untiled"] += 1
    try:
        yield
    finally:
        _settings["untiled"] -= 1


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


# NOTE [Recompute ends before the tiled forward]
# Invariant: inside a non-reentrant checkpoint, a tiled MLP runs no more forwards per step than an untiled one
# (where nothing after the MLP saves). torch's early stop ends a region's recompute at its last saved tensor, and
# a Function's ``save_for_backward`` is packed after its forward has returned: a tiled Function that saved its own
# input would make the recompute run the whole tiled forward only to throw its output away.
# Rule: the input is saved by a node of its own, ``SaveMLPInput``, an identity (a view) applied just before; the
# tiled Function saves nothing and its backward reads the input from that node (``input_node``). Sound because the
# identity's output feeds only the tiled node: the engine runs the tiled backward first, the identity's after it
# passes the gradient through without reading, and saved tensors are released only after their node's own
# backward, so a checkpointed tensor is still unpacked once per backward. Where the MLP input does not require
# grad, an empty leaf that does (``anchor``) makes the identity a node at all. Where something after the MLP saves
# (Gemma's post-feedforward norm) or early stop is off, the recompute runs the tiled forward, as it must.
# Test: tests/test_tiled_mlp_recompute.py::test_tiled_mlp_runs_no_extra_forward_in_the_recompute.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
class SaveMLPInput(torch.autograd.Function):
    """``x2d -> x2d`` (a view) that saves ``x2d`` for the TiledMLPFunction applied to its output, which reads it
    from this node in its backward. NOTE [Recompute ends before the tiled forward]. ``read``: the MLP's parameters,
    saved beside it for torch's version check, in a tuple so that they are no inputs of this node
    (NOTE [The replay reads what the forward read]). ``anchor``: an empty leaf that requires grad, passed only
    when ``x2d`` does not, so that this node is recorded (and saves) at all."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, read: tuple, *anchor: torch.Tensor):
        ctx.anchors = len(anchor)
        ctx.set_materialize_grads(False)  # a frozen input gets None from the tiled backward: no zeros made
        ctx.save_for_backward(x2d, *read)
        return x2d.view_as(x2d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        # Pass-through. Its saved input is never read here: the tiled backward, which runs first, read it (under
        # a non-reentrant checkpoint a saved tensor can be unpacked once per backward).
        return (grad, None, *([None] * ctx.anchors))


# NOTE [Why the parameters are inputs of the Function]
# Invariant: a tiled MLP runs each trainable parameter's AccumulateGrad (and DDP's hook) exactly once per backward,
# in the outer graph task, whatever the shard count. The forward runs shard by shard under no_grad and each shard
# is recomputed in backward; ``.backward()`` per shard would be a graph task, and a hook, per shard ("marked ready
# twice"), and parameters reached only by a nested backward are unreachable from the outer output
# (find_unused_parameters=True marks them unused first, then their hook is a second mark).
# Rule: every trainable parameter the MLP uses (LoRA A/B, DoRA magnitudes, biases, full weights) is an explicit
# input of the Function. Backward takes ``torch.autograd.grad`` per shard w.r.t. the shard and those parameters
# (``grad`` runs no AccumulateGrad, so no DDP hook fires inside) and returns the summed gradients once. So
# find_unused True/False, static_graph (one node, whatever the shard count), bucket views and no_sync all hold,
# and a frozen MLP input still gives LoRA gradients.
# Test: tests/test_tiled_mlp.py::test_each_ddp_hook_fires_once_per_backward.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
class TiledMLPFunction(torch.autograd.Function):
    """``out = cat(forward_fn(shard) for shard in x2d.split(rows))`` with the backward of
    NOTE [Why the parameters are inputs of the Function]. ``params`` are exactly the trainable parameters
    ``forward_fn`` uses. ``x2d`` is the output of ``SaveMLPInput`` and ``input_node`` that node (its ``grad_fn``):
    this Function saves nothing and reads the input from there (NOTE [Recompute ends before the tiled forward]);
    ``want_x`` is whether the MLP's input itself requires grad (``x2d`` may only because of the anchor).
    """

    @staticmethod
    def forward(ctx, forward_fn: Callable, rows: list[int], input_node, want_x: bool, slots: tuple,
                x2d: torch.Tensor, *params: torch.Tensor):
        ctx.forward_fn, ctx.rows, ctx.params = forward_fn, rows, params
        ctx.input_node, ctx.want_x, ctx.slots = input_node, want_x, slots
        ctx.autocast = _autocast_state(x2d.device.type)
        ctx.rng_states = []
        out, start = None, 0
        for shard in x2d.split(rows):
            ctx.rng_states.append(_rng_state(x2d.device))
            y = forward_fn(shard)
            if out is None:  # written in place: no list of shard outputs plus a concatenated copy
                out = y.new_empty((x2d.shape[0], y.shape[-1]))
            out[start:start + shard.shape[0]] = y
            start += shard.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # It has not run its backward yet (it comes after this node); unpacking runs torch's version check on the
        # input and the parameters: NOTE [The replay reads what the forward read].
        x2d = ctx.input_node.saved_tensors[0]
        with _as_in_forward(ctx.slots):
            return (None, None, None, None, None, *_backward(ctx, x2d, grad_out))


def _backward(ctx, x2d: torch.Tensor, grad_out: torch.Tensor) -> list:
    """[dx, *param grads] of TiledMLPFunction: each shard replayed and differentiated
    (NOTE [Why the parameters are inputs of the Function])."""
    want_x = ctx.want_x and ctx.needs_input_grad[5]
    wanted = [i for i, need in enumerate(ctx.needs_input_grad[6:]) if need]
    if torch.is_grad_enabled():  # backward(create_graph=True): NOTE [A differentiable tiled backward]
        return _differentiable_grads(ctx, x2d, grad_out, want_x, wanted)
    dx = torch.empty_like(x2d) if want_x else None
    grads: list[torch.Tensor | None] = [None] * len(ctx.params)
    start = 0
    for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
        shard = shard.detach().requires_grad_(want_x)
        got = _shard_grads(ctx, shard, g_shard, rng, want_x, wanted, create_graph=False)
        if want_x:
            dx[start:start + shard.shape[0]] = got[0] if got[0] is not None else 0
            got = got[1:]
        for i, g in zip(wanted, got):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i].add_(g)
        start += shard.shape[0]
    return [dx, *_unused_as_untiled(ctx, grads, wanted)]


def _unused_as_untiled(ctx, grads: list, wanted: list[int]) -> list:
    """A parameter no shard used gets None, as untiled (its AccumulateGrad runs with no gradient and leaves .grad
    alone; the DDP rescue counts it as without a gradient: NOTE [Unused everywhere ends with grad None]), or a
    defined zero where a static-graph DDP needs one (NOTE [Static graph needs a defined zero])."""
    for i in wanted:
        if grads[i] is None and needs_defined_zero(ctx.params[i]):
            grads[i] = torch.zeros_like(ctx.params[i])
    return grads


# NOTE [Replaying the forward exactly]
# Invariant: the tiled backward differentiates exactly the tensors the forward produced. Each shard's recompute
# runs under the RNG state that shard saw in forward (dropout masks, LoRA dropout included) and the forward's
# autocast state, and calls the class's original ``forward``: nothing about the MLP is re-implemented, so it is
# exact for every family (gelu or silu, bias or not, PEFT and bitsandbytes layers inside).
# Test: tests/test_tiled_mlp.py::test_dropout_masks_are_replayed.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def _shard_grads(ctx, shard: torch.Tensor, g_shard: torch.Tensor, rng: tuple, want_x: bool, wanted: list[int],
                 create_graph: bool) -> tuple:
    """One shard's forward replayed (its RNG and autocast state) and its gradients: wrt ``shard`` when
    ``want_x``, then wrt each wanted parameter (None where the shard does not use it)."""
    with _replay(shard.device, rng, ctx.autocast), torch.enable_grad():
        out = ctx.forward_fn(shard)
    inputs = ([shard] if want_x else []) + [ctx.params[i] for i in wanted]
    if not inputs:  # reached, yet nothing of its own wants a gradient (a tiled norm whose output another path read)
        return ()
    return torch.autograd.grad(out, inputs, g_shard, allow_unused=True, create_graph=create_graph)


# NOTE [A differentiable tiled backward]
# Invariant: a double backward through a tiled MLP (a gradient penalty: ``autograd.grad(..., create_graph=True)``
# then ``backward()``) gives the untiled gradients. Shards taken as detached tensors would make dx and the
# parameter gradients constants to the second backward.
# Rule: when the engine runs this backward with grad mode on (it does exactly under ``create_graph=True``), each
# shard is replayed as a view of the saved input itself (its history intact), differentiated with
# ``create_graph``, and the pieces are joined out of place. It keeps each shard's graph, as untiled keeps the whole
# call's (the untiled memory, for the untiled gradients); the first-order path is unchanged.
# Test: tests/test_tiled_mlp.py::test_double_backward_through_tiled_mlp_matches_untiled.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def _differentiable_grads(ctx, x2d: torch.Tensor, grad_out: torch.Tensor, want_x: bool, wanted: list[int]) -> list:
    """[dx, *param grads] of a backward under ``create_graph=True``, each recorded by autograd."""
    dx_parts, grads = [], [None] * len(ctx.params)
    for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
        got = _shard_grads(ctx, shard if want_x else shard.detach(), g_shard, rng, want_x, wanted, create_graph=True)
        if want_x:
            dx_parts.append(got[0] if got[0] is not None else torch.zeros_like(shard))
            got = got[1:]
        for i, g in zip(wanted, got):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
    return [torch.cat(dx_parts) if want_x else None, *_unused_as_untiled(ctx, grads, wanted)]


def apply_tiled(forward_fn: Callable, rows: list[int], x2d: torch.Tensor, params: tuple[torch.Tensor, ...],
                module: torch.nn.Module | None = None) -> torch.Tensor:
    """The tiled MLP on ``x2d`` (tokens x hidden): its input saved by a SaveMLPInput node placed before the
    TiledMLPFunction, which saves nothing (NOTE [Recompute ends before the tiled forward]). ``module``: the MLP
    ``forward_fn`` runs (or a tuple of the modules it runs), whose tensors the replay reads as the forward did
    (NOTE [The replay reads what the forward read]); None (a direct call, as the memory simulator makes)
    records and saves nothing more."""
    slots = _slots(module) if module is not None else ()
    read = tuple({id(t): t for _, _, t, is_param in slots if is_param}.values())
    want_x = x2d.requires_grad
    anchor = () if want_x else (torch.empty(0, device=x2d.device, requires_grad=True),)
    saved = SaveMLPInput.apply(x2d, read, *anchor)
    return TiledMLPFunction.apply(forward_fn, rows, saved.grad_fn, want_x, slots, saved, *params)


# NOTE [The replay reads what the forward read]
# Invariant: the tiled backward differentiates the tensors the forward read, holding the values they held then,
# or raises as torch does. Its replay calls the MLP again at backward time, when the module may hold other
# tensors (``torch.func.functional_call``, SAM's perturbed weights: restored by then) or the same ones edited in
# place (an edited weight was replayed silently; substituted weights got no gradient).
# Rule: each tiled call records the MLP's parameter and buffer slots with the tensors in them (``_slots``); the
# replay puts back any the module no longer holds and restores the module after (``_as_in_forward``). Every
# parameter, trainable or frozen, is saved by ``SaveMLPInput`` beside the input (references: no memory), so
# torch's version check raises on an in-place edit, as untiled; also where untiled kept only intermediates (a
# bias, a frozen weight whose input needs no grad), whose edit a replay could only get wrong. Under
# ``parametrize.cached()`` a parametrized weight would be computed once, inside the no_grad forward: such a call
# runs untiled with one WARNING line.
# Test: tests/test_tiled_mlp_replay.py::test_functional_call_with_substituted_parameters_is_exact.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def _slots(module: torch.nn.Module) -> tuple:
    """(slot dict, name, tensor, is a parameter) for every parameter and buffer ``module`` and its submodules
    hold now: what its forward reads (NOTE [The replay reads what the forward read]). A walk of the dicts
    themselves: ``functional_call`` puts its tensors there."""
    found, seen, stack = [], set(), list(module) if isinstance(module, tuple) else [module]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        found += [(m._parameters, n, t, True) for n, t in m._parameters.items() if t is not None]
        found += [(m._buffers, n, t, False) for n, t in m._buffers.items() if t is not None]
        stack.extend(m._modules.values())
    return tuple(found)


_MISSING = object()


@contextlib.contextmanager
def _as_in_forward(slots: tuple):
    """The module holds the forward's tensors inside this block (a no-op where it still does: the usual case)."""
    moved = [(d, n, t, d.get(n, _MISSING)) for d, n, t, _ in slots if d.get(n) is not t]
    for d, n, t, _ in moved:
        d[n] = t
    try:
        yield
    finally:
        for d, n, _, held in reversed(moved):
            if held is _MISSING:
                d.pop(n, None)
            else:
                d[n] = held



def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replay(device: torch.device, rng: tuple, autocast: tuple):
    cpu_state, cuda_state = rng
    devices = [device] if cuda_state is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        device_type, enabled, dtype, cpu_enabled, cpu_dtype = autocast
        device_ctx = torch.autocast(device_type, dtype=dtype, enabled=enabled) if device_type != "cpu" \
            else contextlib.nullcontext()
        with device_ctx, torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_enabled):
            yield


def _autocast_state(device_type: str) -> tuple:
    enabled = torch.is_autocast_enabled(device_type) if device_type != "cpu" else False
    dtype = torch.get_autocast_dtype(device_type) if device_type != "cpu" else None
    return (device_type, enabled, dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))


def _long_enough(rows: int, hidden: int) -> bool:
    """Could this call tile at all? (Before the probe and before I is read.)"""
    shard_tokens = _settings["shard_tokens"]
    return rows > shard_tokens if shard_tokens is not None else rows // max(hidden, 1) >= 2


def _plan(module: torch.nn.Module, x: torch.Tensor, rows: int, hidden: int) -> list[int]:
    shard_tokens = _settings["shard_tokens"]
    if shard_tokens is not None:
        return shard_sizes(rows, hidden, shard_tokens)
    return shard_sizes(rows, hidden, None, _intermediate(module, x))


def _make_tiled_forward(original_forward: Callable) -> Callable:
    def forward(self, *args, **kwargs):  # any call the original accepts passes through; only forward(x) tiles
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or _settings["untiled"] \
                or not torch.is_grad_enabled() or not is_distributed() \
                or engines.compiling():  # under dynamo: silent (a log call breaks the graph); NOTE [Engines]
            return original_forward(self, *args, **kwargs)
        x = args[0]
        engine = engines.of_module(self)
        if not engines.acts("tiled_mlp", engine):
            engines.step_aside("tiled_mlp", engine)
            return original_forward(self, x)
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        params = tuple(p for p in self.parameters() if p.requires_grad)
        if not (params or x.requires_grad) or not _long_enough(rows, hidden) \
                or _hooked(self, params) or _cached_parametrization(self) \
                or _verdict(self, x, original_forward) is not None \
                or _reaches_outside(self, x, original_forward):
            return original_forward(self, x)
        sizes = _plan(self, x, rows, hidden)
        if len(sizes) == 1:
            return original_forward(self, x)
        _counts["tiled_calls"] += 1
        _counts["shards"] += len(sizes)
        out = apply_tiled(lambda shard: original_forward(self, shard), sizes, x.reshape(rows, hidden), params,
                          module=self)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _cached_parametrization(module: torch.nn.Module) -> bool:
    """Whether a parametrized weight of ``module`` would be cached inside the no_grad tiled forward (or a probe)
    and the replay then read it without history; logs why (NOTE [The replay reads what the forward read]).
    Decided before the probes: under the cache they would fill it with a tensor without history."""
    if not getattr(parametrize, "_cache_enabled", 0) \
            or not any(parametrize.is_parametrized(m) for m in module.modules()):
        return False
    log_rank0_once(f"tiled-cached-{type(module).__qualname__}", logging.WARNING,
                   "ddp_patches: tiled MLP: %s runs untiled: a parametrized weight inside "
                   "torch.nn.utils.parametrize.cached() (NOTE [The replay reads what the forward read] in "
                   "ddp_patches/tiled_mlp.py)", type(module).__qualname__)
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
    why = _hook_problem(module, params)
    if why is not None:
        log_rank0_once(f"tiled-hook-{type(module).__qualname__}-{why}", logging.WARNING,
                       "ddp_patches: tiled MLP: %s runs untiled: %s (hooks there would fire once per shard; "
                       "NOTE [Hooks inside a tiled MLP] in ddp_patches/tiled_mlp.py)", type(module).__qualname__, why)
    return why is not None


def _hook_problem(module: torch.nn.Module, params: tuple) -> str | None:
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
def _intermediate(module: torch.nn.Module, x: torch.Tensor) -> int:
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
        _outside[module] = _outside_tensor(module, x.detach().reshape(-1, x.shape[-1])[:2], original_forward)
        if _outside[module] is not None:
            cls = type(module)
            log_rank0_once(f"tiled-outside-{cls.__qualname__}-{_outside[module]}", logging.WARNING,
                           "ddp_patches: tiled MLP: a %s.%s runs untiled: %s", cls.__module__, cls.__qualname__,
                           _outside[module])
    return _outside[module] is not None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _outside_tensor(module: torch.nn.Module, rows: torch.Tensor, original_forward: Callable) -> str | None:
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


def _is_candidate_class(cls: type) -> bool:
    """The class's ``__init__`` (its own or inherited) assigns gate_proj, up_proj and down_proj."""
    init = next((vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None)
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    return all(n in names for n in _GATED)


def _forward_owner(cls: type) -> type | None:
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    return None if owner in (None, torch.nn.Module) else owner


def _patch_class(cls: type) -> bool:
    owner = _forward_owner(cls)
    if owner is None or REGISTRY.is_patched(owner, "forward"):
        return False
    REGISTRY.install(owner, "forward", _make_tiled_forward)
    return True


def discover(model: torch.nn.Module) -> list[str]:
    """Patch the forward of every gate/up/down MLP class in ``model`` (an instance check; the probe comes at the
    first call). Called for you when a transformers model is built after apply() and when DDP wraps a module;
    call it yourself for a non-transformers model that FSDP2 shards and that was built before apply()."""
    if not enabled():
        return []
    found = [name for other in _also_discover for name in other(model)]  # apply(tiled_attention=True)'s
    if not _settings["mlp"]:
        return found
    for cls in {type(m) for m in model.modules() if _structure_problem(m) is None}:
        if _patch_class(cls):
            found.append(f"{cls.__module__}.{cls.__qualname__}")
    if found:
        log_rank0_once("tiled-found-" + ",".join(sorted(found)), logging.INFO,
                       "ddp_patches: tiled MLP: gate/up/down MLP classes found on %s: %s",
                       type(model).__qualname__, ", ".join(sorted(found)))
    return found


def _imported_candidates() -> list[type]:
    seen, stack, found = set(), [torch.nn.Module], []
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if _is_candidate_class(sub):
                    found.append(sub)
    return found


def _discover_after_post_init(original_post_init: Callable) -> Callable:
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        discover(self)
        return result

    return post_init


def enabled() -> bool:
    """apply(tiled_mlp=True) or apply(tiled_attention=True) is in effect (the discovery hook is installed).

    transformers is optional: where it was never imported, install() (which imports it) has not run, and a
    torch-only process must not need it to build a DDP.
    """
    if sys.modules.get("transformers") is None:
        return False
    from transformers import PreTrainedModel

    return REGISTRY.is_patched(PreTrainedModel, "post_init")


def install(*, shard_tokens: int | None) -> list[str]:
    """Patch the gate/up/down MLP classes imported so far, and discover the rest on models as they are built
    or wrapped (NOTE [MLPs found by structure])."""
    try:
        from transformers import PreTrainedModel  # noqa: F401 - install_discovery() patches it
    except ImportError as exc:
        raise ImportError(
            "ddp_patches: apply(tiled_mlp=True) tiles the MLPs of transformers models, and needs transformers "
            f"(importing it failed: {exc}). Install it (pip install 'ddp_patches[hf]', or transformers>=4.46), or "
            "leave tiled_mlp off; the other patches need no transformers") from exc

    _settings["shard_tokens"] = shard_tokens
    _settings["mlp"] = True
    _counts.update(tiled_calls=0, shards=0)
    _verdicts.clear()
    _measured_intermediate.clear()
    _outside.clear()
    installed = install_discovery()
    patched = [f"{c.__module__}.{c.__qualname__}" for c in _imported_candidates() if _patch_class(c)]
    logger.debug("ddp_patches: tiled MLP patched %d gate/up/down classes already imported", len(patched))
    return installed + [f"{name}.forward" for name in sorted(patched)]


def install_discovery() -> list[str]:
    """The hook that finds tiled classes on each transformers model built (the tiled MLP's and attention's)."""
    from transformers import PreTrainedModel

    if REGISTRY.is_patched(PreTrainedModel, "post_init"):
        return []
    REGISTRY.install(PreTrainedModel, "post_init", _discover_after_post_init)
    return ["transformers.PreTrainedModel.post_init (tiled-MLP discovery)"]


def _forget() -> None:
    _settings["mlp"] = False
    _also_discover.clear()


REGISTRY.on_reset(_forget)
