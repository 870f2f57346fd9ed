"""The graph walk below a DDP's outputs and the custom-Function watch that lets it be skipped.

``walk_graph`` names the custom autograd Functions under the outputs (one that may run a nested backward, those
whose backward issues a collective); ``watch_custom_functions`` (from the first DDP built under apply()) skips the
walk while no such node exists. ``_leads_to`` / ``_skipped_below`` tell whether a later backward of the same
forward may still reach a parameter (NOTE [Several backwards of one forward] in ddp_patches/rescue/edges.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .._registry import REGISTRY
from .counts import _pick


# NOTE [Unused parameters marked where DDP marks them]
# Invariant: a parameter fired without a gradient has its bucket all-reduced in the same place among the group's
# collectives on every rank. Collectives pair by order; DDP's find_unused_parameters=True marks unreachable
# parameters at the first hook of the backward, and a hook fired at the END instead moves its bucket behind every
# other collective of the backward (a second DDP on the group, a differentiable all-reduce, SyncBatchNorm) on the
# rank that lacked the gradient only: buffers of equal size mix silently, unequal ones abort.
# Rule: at ``_BackwardStart``, a parameter whose AccumulateGrad this graph task will not run
# (``torch._C._will_engine_execute_node``) fires there, if the task accumulates into some other parameter and no
# custom Function in the DDP's graph may run a nested backward that reaches it (``walk_graph``, from every
# forward's start node since the last settle; Functions known to run none are listed by name). The end of the
# backward fires only what is left. Where a parameter fired late here but not on every rank while another
# collective ran on the group in this backward, the rank raises before any optimizer step, naming the fixes.
# Test: tests/test_reach_order.py::test_two_ddps_on_one_group_train_exactly.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
_NO_NESTED_BACKWARD = frozenset({
    "torch.nn.parallel.distributed._DDPSink",
    # a module's full backward hooks: in torch.nn.modules._functions from torch 2.13, torch.utils.hooks before
    "torch.nn.modules._functions.BackwardHookFunction", "torch.utils.hooks.BackwardHookFunction",
    "torch.nn.modules._functions.SyncBatchNorm", "torch.nn.modules._functions.CrossMapLRN2d",
    "bitsandbytes.autograd._functions.MatMul4Bit", "bitsandbytes.autograd._functions.MatMul8bitLt",
    "bitsandbytes.autograd._functions.MatMul8bitFp",
    "ddp_patches.rescue.edges._BackwardStart", "ddp_patches.rescue.edges._FireHooks",
    "ddp_patches.tiled_mlp.function.SaveMLPInput", "ddp_patches.tiled_mlp.function.TiledMLPFunction",
    "torch.utils.checkpoint._NoopSaveInputs",  # (torch < 2.13) a non-reentrant checkpoint's frame, never run
})
# Functions whose backward issues a collective on a process group (they run no nested backward either).
_COLLECTIVES = frozenset({f"torch.distributed.nn.functional.{name}" for name in (
    "_AllGather", "_AllGatherBase", "_AllReduce", "_AlltoAll", "_AlltoAllSingle", "_Broadcast", "_Gather", "_Reduce",
    "_Reduce_Scatter", "_Scatter")} | {"torch.nn.modules._functions.SyncBatchNorm"})


@dataclasses.dataclass
class GraphFacts:
    may_nest: str | None  # the first custom Function that may run a nested backward, by name
    collectives: list[str]  # custom Functions whose backward issues a collective


def walk_graph(nodes: list) -> GraphFacts:
    """The custom autograd Functions below ``nodes`` (down to the leaves): which may nest, which communicate."""
    may_nest, collectives = None, []
    seen = set(nodes)
    stack = [fn for node in nodes for fn, _ in node.next_functions if fn is not None]
    pop, push, visit = stack.pop, stack.append, seen.add
    # Node type -> its Function's name, None for a built-in node: one lookup per type. A leaf has nothing below.
    kinds: dict[type, str | None] = {_ACCUMULATE_GRAD: None}
    while stack:
        fn = pop()
        if fn in seen:
            continue
        visit(fn)
        kind_of = type(fn)
        if kind_of is _ACCUMULATE_GRAD:
            continue
        kind = kinds.get(kind_of, "")
        if kind == "":
            cls = getattr(fn, "_forward_cls", None)
            kind = kinds[kind_of] = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
        if kind is not None:
            if kind in _COLLECTIVES:
                collectives.append(kind)
            elif kind not in _NO_NESTED_BACKWARD and may_nest is None:
                may_nest = kind
        for below, _ in fn.next_functions:
            if below is not None:
                push(below)
    return GraphFacts(may_nest, collectives)


# NOTE [No walk without a custom Function]
# Invariant: the walk below the outputs (NOTE [Unused parameters marked where DDP marks them]) finds a Function
# that may nest a backward or issue a collective whenever one is in the graph, at no cost where none exists.
# Rule: from the first DDP built under apply() (never in one process), each custom Function node is seen as made
# (``BackwardCFunction.__init__``: THPFunction_apply instantiates it per call) and, unless its Function is listed
# as running no nested backward and no collective, kept weakly in ``_NODES_TO_WALK``. Where that set is empty no
# graph holds such a node and the walk is skipped; otherwise (or where the watch is off) it runs as before. A node
# made before the first DDP was built is not seen (it reaches a DDP's graph only through an input made before it).
# Test: tests/test_reach_order.py::test_a_late_fire_among_collectives_fails_loudly, ::test_the_custom_function_watch_starts_with_the_first_ddp
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
_NODES_TO_WALK: weakref.WeakSet = weakref.WeakSet()
_NODE_KINDS: dict[type, bool] = {}  # node type -> whether its Function may nest a backward or communicate
_watching = [False]
_WATCH_TARGET = "torch.autograd.function.BackwardCFunction.__init__"


def _watch_node(node: Any, *args: Any, **kwargs: Any) -> None:
    kind = type(node)
    keep = _NODE_KINDS.get(kind)
    if keep is None:
        cls = getattr(node, "_forward_cls", None)
        name = "" if cls is None else f"{cls.__module__}.{cls.__qualname__}"
        keep = _NODE_KINDS[kind] = name in _COLLECTIVES or name not in _NO_NESTED_BACKWARD
    if keep:
        _NODES_TO_WALK.add(node)


class _Unwatch:
    """The handle revert() removes: custom Function nodes are no longer watched."""

    def remove(self) -> None:
        from torch.autograd.function import BackwardCFunction

        if vars(BackwardCFunction).get("__init__") is _watch_node:
            del BackwardCFunction.__init__
        _watching[0] = False
        _NODES_TO_WALK.clear()


def watch_custom_functions() -> list[str]:
    """NOTE [No walk without a custom Function]: where ``BackwardCFunction`` defines no ``__init__`` of its own and
    a custom Function's node is seen as it is made (tried here once), the walk is skipped while none exists."""
    from torch.autograd.function import BackwardCFunction

    if _watching[0]:
        return [_WATCH_TARGET]
    if "__init__" in vars(BackwardCFunction):
        return []  # someone else's: the walk runs every backward
    BackwardCFunction.__init__ = _watch_node
    handle = _Unwatch()
    try:
        with torch.enable_grad():  # a DDP built under no_grad(): the probe still makes its node
            probe = _ProbeStart.apply(None, None, torch.ones(1, requires_grad=True))  # listed under no name: kept
        seen = probe.grad_fn in _NODES_TO_WALK
    except Exception:  # noqa: BLE001 - any failure: no watch, the walk runs every backward
        seen = False
    _NODES_TO_WALK.clear()
    if not seen:
        handle.remove()
        return []
    _watching[0] = True
    REGISTRY.add_handle(handle)
    return [_WATCH_TARGET]


def _walk_below(nodes: list) -> GraphFacts:
    """``walk_graph``, skipped where no custom Function that matters exists (NOTE [No walk without a custom Function])."""
    if _watching[0] and not _NODES_TO_WALK:
        return GraphFacts(None, [])
    return walk_graph(nodes)


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
# The C getters, called directly: a Parameter's attribute lookup costs twice as much per call.
_REQUIRES_GRAD = torch.Tensor.requires_grad.__get__
_GRAD = torch.Tensor.grad.__get__
_WILL_RUN = torch._C._will_engine_execute_node
_FLIP = bytes([1, 0]) + bytes(254)  # bytearray.translate: 0 <-> 1


# NOTE [Only a backward that accumulates]
# Invariant: a backward that accumulates into none of the DDP's parameters fires no hook and settles nothing.
# ``torch.autograd.grad`` through the outputs (saliency, an adversarial step, a gradient penalty) and
# ``backward(inputs=[x])`` run no AccumulateGrad node, so DDP's hooks do not fire and the reducer waits for the
# loss's own backward; firing "missing" hooks there would finalize the reducer with zeros and ignore the real
# hooks after it (silently wrong gradients).
# Rule: no settle is queued inside ``autograd.grad`` (the engine, asked there about a leaf it does not
# differentiate for, raises), and a settle queued in a ``backward()`` acts only if some AccumulateGrad of the DDP's
# parameters ran in it, nested graph tasks included (a custom reentrant Function runs them in nested backwards the
# outer graph cannot see: the settle is at the end of the OUTER backward). Where nothing ran, the forward's
# reduction is still to come: armed again. ``backward(inputs=...)`` naming only some parameters, keeping the graph,
# leaves those it skips (below an output it ran through, not run) to a later backward through the same outputs
# (NOTE [Several backwards of one forward]); the last stage fires what none reached. Freeing it, it is taken as a
# full backward (the others are fired).
# Test: tests/test_reach_backwards.py::test_backward_with_inputs_in_two_stages_trains_as_ddp_does; Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _static(ddp: nn.Module) -> bool:
    return bool(getattr(ddp, "static_graph", False))


def _live(starts: list) -> list:
    """The start nodes still alive in ``starts`` (per forward, a tuple of weak references)."""
    return [node for refs in starts for node in (ref() for ref in refs) if node is not None]


def _keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``). Where torch cannot say (older releases),
    False: a kept output joining what this backward ran is then a branch without a gradient, and a second backward
    through a retained shared graph raises (NOTE [A backward after the reduction]), never trains wrong."""
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return False if get is None else bool(get())


def _leads_to(root: Any, targets: set[int], will_run: Callable, keeps_graph: bool) -> bool:
    """Whether a later backward through ``root`` (an output this backward does not run through) may reach a node in
    ``targets``, or a Function that may nest a backward. Where its graph joins what this backward runs and frees,
    no later backward can run through it (NOTE [Several backwards of one forward])."""
    seen, stack, found = {id(root)}, [fn for fn, _ in root.next_functions if fn is not None], False
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if will_run(fn):  # runs in this backward, and so does everything below it
            if keeps_graph:
                continue
            return False  # its saved tensors are freed at the end of this backward
        cls = getattr(fn, "_forward_cls", None)
        may_nest = cls is not None and f"{cls.__module__}.{cls.__qualname__}" not in _NO_NESTED_BACKWARD
        if id(fn) in targets or may_nest:
            if keeps_graph:
                return True
            found = True  # and it stays, unless the graph joins this backward's below
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return found


def _skipped_below(running: list, targets: set[int], will_run: Callable) -> bool:
    """Whether a node in ``targets`` (or a Function that may nest a backward) lies below ``running`` (outputs this
    backward runs through, keeping the graph) and does not run: ``backward(inputs=...)`` skipped it, so a later
    backward through the same outputs may run it. In a backward that runs all below them, none is found."""
    seen, stack = set(map(id, running)), [fn for node in running for fn, _ in node.next_functions if fn is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if id(fn) in targets:
            return True  # an unreached parameter in this graph: not run here, not unreachable
        cls = getattr(fn, "_forward_cls", None)
        if cls is not None and f"{cls.__module__}.{cls.__qualname__}" not in _NO_NESTED_BACKWARD and not will_run(fn):
            return True
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return False


def _in_autograd_grad(nodes: list) -> bool:
    try:  # any one leaf tells: the engine raises for every leaf while it runs autograd.grad()
        torch._C._will_engine_execute_node(nodes[0]) if nodes else None
    except RuntimeError:  # "A leaf node was passed ... but we are currently running autograd.grad()"
        return True
    return False


class UnreachedAtStart:
    """The part of ``UnusedParameterEdges`` (ddp_patches/rescue/edges.py) that decides, as a backward starts, which
    parameters it cannot reach (NOTE [Unused parameters marked where DDP marks them])."""

    def _fire_unreachable(self, ddp: nn.Module, node: Any) -> None:
        """NOTE [Unused parameters marked where DDP marks them]: at the start of the backward, the parameters
        this graph task cannot reach fire now, unless a Function below may reach them in a nested backward."""
        # Thousands of parameters per backward (an MoE's idle experts): each pass below runs at C speed.
        runs = bytearray(map(_WILL_RUN, self._nodes))
        n_run = runs.count(1)
        if n_run == len(runs) or not n_run:
            return  # all reached; or none: autograd.grad / backward(inputs=x) (NOTE [Only a backward that accumulates])
        unreachable = list(itertools.compress(range(len(runs)), runs.translate(_FLIP)))
        if self._fired:
            unreachable = list(itertools.filterfalse(self._fired.__contains__, unreachable))
        # A parameter frozen since the DDP was built has no edge to fire: the trainable-set guard names it instead
        # (NOTE [A frozen parameter is judged at the backward]).
        params = _pick(self._params, unreachable)
        trainable = bytearray(map(_REQUIRES_GRAD, params))
        if trainable.count(1) != len(params):
            unreachable = list(itertools.compress(unreachable, trainable))
            params = _pick(self._params, unreachable)
        if not unreachable:
            return
        if self._later_backward_may_reach(unreachable, static=_static(ddp)):
            return  # decided at the end: NOTE [Several backwards of one forward]
        self._graph = _walk_below(_live(self._starts) or [node])
        if self._graph.may_nest:
            return  # decided at the end, as a nested backward may still accumulate them
        grads = list(map(_GRAD, params))
        self._early_no_grad += unreachable if grads.count(None) == len(grads) else itertools.compress(
            unreachable, map(operator.is_, grads, itertools.repeat(None)))
        del grads  # a reference held through the fire would make AccumulateGrad's static-graph zero out-of-place
        self._early += unreachable
        self._fire(ddp, unreachable)

    def _later_backward_may_reach(self, unreached: list[int], starts: list | None = None, *,
                                  static: bool = False) -> bool:
        """NOTE [Several backwards of one forward]: whether a later backward of the forwards since the last settle
        may still reach one of the ``unreached`` parameters (or a Function that may run a nested backward)."""
        will_run = torch._C._will_engine_execute_node
        live = _live(self._starts if starts is None else starts)
        roots = [node for node in live if not getattr(node, "ran", False) and not will_run(node)]
        keeps_graph = _keeps_graph()
        # NOTE [Only a backward that accumulates]: one that keeps its graph may have run only part of it; not under
        # static_graph, whose reducer reduces at the first stage's end (torch alone trains such stages unaveraged)
        running = [node for node in live if will_run(node)] if keeps_graph and not static else []
        if not roots and not running:
            return False
        targets = {id(self._nodes[i]) for i in unreached}
        return (any(_leads_to(root, targets, will_run, keeps_graph) for root in roots)
                or _skipped_below(running, targets, will_run))


# -- the watch's own probe (and the rescue's: ddp_patches/rescue/edges.py) --------------------------------------
class _ProbeStart(torch.autograd.Function):
    """Identity whose backward queues ``callback`` as a final callback of the graph task, as _BackwardStart does."""

    @staticmethod
    def forward(ctx, callback, node, x):
        ctx.callback, ctx.node = callback, node
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        will_run = torch._C._will_engine_execute_node(ctx.node)
        task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: ctx.callback(will_run, task))
        return None, None, grad
