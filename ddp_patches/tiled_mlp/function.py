"""The tiled MLP's autograd Functions: a call split into token shards, each replayed and differentiated in backward.

``apply_tiled(forward_fn, rows, x2d, params)`` runs ``forward_fn`` shard by shard under no_grad through
``TiledMLPFunction``, its input saved by a ``SaveMLPInput`` node placed before it; the backward replays each shard
under its forward's RNG and autocast state and returns one summed gradient per parameter. The tiled attention and
the memory simulator call it too.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..rescue.edges import needs_defined_zero

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
    dtypes: dict[int, torch.dtype] = {}  # a gradient summed in float32 -> its own dtype
    start = 0
    for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
        shard = shard.detach().requires_grad_(want_x)
        got = _shard_grads(ctx, shard, g_shard, rng, want_x, wanted, create_graph=False)
        if want_x:
            dx[start:start + shard.shape[0]] = got[0] if got[0] is not None else 0
            got = got[1:]
        for i, g in zip(wanted, got):
            if g is not None:
                grads[i] = g if grads[i] is None else _widened(grads[i], dtypes, i).add_(g)
        start += shard.shape[0]
    for i, dtype in dtypes.items():
        grads[i] = grads[i].to(dtype)
    return [dx, *_unused_as_untiled(ctx, grads, wanted)]


# NOTE [Shard gradients are summed in float32]
# Rule: a half-precision parameter's shard gradients are added up in float32 and rounded to its dtype once, at
# the end, as untiled rounds its one matmul's float32 sum once. Added in bfloat16, each shard's sum rounds again:
# at 128 shards, LoRA gradients under FSDP2's bfloat16 compute were twice as far from float32 as untiled. One
# shard, or float32 parameters, take no copy; the float32 sum lives for one tiled call's backward (a double
# backward's too, out of place): for a trained half-precision weight, a float32 copy of its gradient meanwhile
# (Llama-8B's MLP in full fine-tuning: 0.7 GB).
# Test: tests/test_tiled_attention.py::test_fsdp2_bf16_shard_gradients_keep_untiled_precision
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §12
def _widened(total: torch.Tensor, dtypes: dict, i: int) -> torch.Tensor:
    """The running sum of parameter ``i``'s shard gradients, in float32 where it is a half-precision tensor (its
    dtype kept in ``dtypes`` for the rounding at the end): NOTE [Shard gradients are summed in float32]."""
    if total.dtype not in (torch.float16, torch.bfloat16):
        return total
    dtypes[i] = total.dtype
    return total.float()


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
    dx_parts, grads, dtypes = [], [None] * len(ctx.params), {}
    for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
        got = _shard_grads(ctx, shard if want_x else shard.detach(), g_shard, rng, want_x, wanted, create_graph=True)
        if want_x:
            dx_parts.append(got[0] if got[0] is not None else torch.zeros_like(shard))
            got = got[1:]
        for i, g in zip(wanted, got):
            if g is not None:
                grads[i] = g if grads[i] is None else _widened(grads[i], dtypes, i) + g
    for i, dtype in dtypes.items():
        grads[i] = grads[i].to(dtype)
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
