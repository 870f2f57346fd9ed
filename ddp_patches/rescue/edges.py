"""Every trainable parameter's DDP hook fires exactly once per synced backward, whatever the data.

``install(ddp)`` attaches ``UnusedParameterEdges`` to a DDP built under apply(); where the reducer does not search
for unused parameters itself (``needed``), a parameter without a gradient fires its hook with none, and one that no
rank used ends with ``.grad`` None (NOTE [Unused parameters without find_unused_parameters]).
``patch_join_hook`` and ``patch_finalize_backward`` keep that in step with Join and manual finalization;
``needs_defined_zero``, ``map_tensors`` and ``for_ddp`` serve the tiled MLP and the other reducer patches.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
import logging
import operator
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.algorithms.join import JoinHook
from torch.utils import _pytree as pytree

from .. import engines, probes
from .._registry import REGISTRY
from ..distributed import log_rank0_once

logger = logging.getLogger("ddp_patches")
_SETTLE_LOCK = threading.Lock()


# NOTE [Several backwards of one forward]
# Invariant: backwards that each run through part of one forward's outputs (an actor-critic's
# ``pg_loss.backward(retain_graph=True); vf_loss.backward()``, an input gradient of one output then ``backward()``
# on another) train as DDP alone trains them: its reducer finalizes once every parameter's hook has fired, in
# whichever backward; a hook fired early with no gradient would finalize it with zeros and drop the later ones.
# Rule: each output gets its own start node, so a backward runs (and frees) only the graph of the outputs it
# passes. A settle whose missing parameters lie below an output still alive that no backward has run through yet
# (or below a Function there that may nest a backward) fires nothing and stays armed, if a later backward can run
# through that output: this backward keeps its graph, or that output's graph does not join what this backward runs
# and frees. The backward that leaves none pending settles; a dropped output takes no backward. A forward that
# comes first logs one WARNING; DDP then raises, as without the library.
# Test: tests/test_reach_backwards.py::test_several_backwards_of_one_forward_train_as_ddp_does.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7


# NOTE [A backward after the reduction]
# Invariant: a backward after DDP finished a forward's reduction raises where DDP alone would still be waiting
# for it. Alone, on a rank where some parameter got no gradient, the reducer waits: a second ``loss.backward()`` of a
# retained graph raises "Expected to mark a variable ready only once", and a backward through a tensor the module
# kept (a probe on detached features) completes the reduction. Once the library has fired that parameter, the
# reducer has finalized and ignores later hooks: their gradients would stay unaveraged, silently.
# Rule: a settle that fired any parameter marks its forward's start nodes and remembers what it fired, until the
# next forward. A later backward through a marked start node that accumulates into the DDP's parameters raises;
# so does a fired parameter that later receives a gradient. A rank that fired nothing lets DDP decide, as alone.
# A backward that keeps its graph and skips parameters (``backward(inputs=...)``) fires none of them: the stage
# after it is no backward after the reduction (NOTE [Only a backward that accumulates]).
# Test: tests/test_reach_backwards.py::test_the_same_loss_backward_twice_raises_as_without_the_library.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
class _BackwardStart(torch.autograd.Function):
    """Identity on one output; its backward (the first node of any backward through it) queues ``_settle``."""

    @staticmethod
    def forward(ctx, edges: "UnusedParameterEdges", ddp: nn.Module, tensor: torch.Tensor):
        ctx.set_materialize_grads(False)  # a None passed down must not become an output-sized zero
        ctx.edges, ctx.ddp = edges, ddp  # held by this graph only, until its backward
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.edges.backward_started(ctx.ddp, ctx)  # ctx is this node: the DDP's graph lies below it
        return None, None, grad


class _FireHooks(torch.autograd.Function):
    """One edge into each parameter's AccumulateGrad node, carrying None, or a zero when ``defined_zeros``."""

    @staticmethod
    def forward(ctx, defined_zeros: bool, *params: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.params = params if defined_zeros else None
        ctx.n_params = len(params)
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        zeros = [torch.zeros_like(p) for p in ctx.params] if ctx.params is not None else [None] * ctx.n_params
        return (None, *zeros)


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
    "torch.nn.parallel.distributed._DDPSink", "torch.utils.hooks.BackwardHookFunction",
    "torch.nn.modules._functions.SyncBatchNorm", "torch.nn.modules._functions.CrossMapLRN2d",
    "bitsandbytes.autograd._functions.MatMul4Bit", "bitsandbytes.autograd._functions.MatMul8bitLt",
    "bitsandbytes.autograd._functions.MatMul8bitFp",
    "ddp_patches.rescue.edges._BackwardStart", "ddp_patches.rescue.edges._FireHooks",
    "ddp_patches.tiled_mlp.SaveMLPInput", "ddp_patches.tiled_mlp.TiledMLPFunction",
    "torch.utils.checkpoint._NoopSaveInputs",  # held by a non-reentrant checkpoint's frame, never backpropagated
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
_GRAD, _SET_GRAD = torch.Tensor.grad.__get__, torch.Tensor.grad.__set__
_WILL_RUN = torch._C._will_engine_execute_node
_FLIP = bytes([1, 0]) + bytes(254)  # bytearray.translate: 0 <-> 1


def _pick(items: list, indices: list) -> tuple:
    """``items[i]`` for each of ``indices``, in one C call."""
    if len(indices) == 1:
        return (items[indices[0]],)
    return operator.itemgetter(*indices)(items) if indices else ()


def _index_tensor(indices: list, device) -> torch.Tensor:
    """``torch.tensor(indices)`` without a Python object per element (``array`` hands its buffer over)."""
    return torch.frombuffer(array.array("q", indices), dtype=torch.int64).to(device)


# NOTE [Firing many hooks at once]
# Invariant: a parameter fired without a gradient is marked ready exactly as its AccumulateGrad would mark it,
# at a cost that does not grow with a graph. Given no gradient, AccumulateGrad writes nothing and calls its
# post-hooks, DDP's among them, which calls ``reducer._autograd_hook(i)`` (i: the parameter's place in the
# reducer's list, ``_build_params_for_reducer``).
# Rule: call the reducer's hook directly, without a nested backward; the reducer then queues its finalize in the
# backward being settled, ahead of the reset. Where the mapping is not exact (no ``_autograd_hook``, a parameter
# the reducer does not list), and under static graph (its first iteration learns "used" from defined gradients, so
# the fire must carry a zero that AccumulateGrad writes: NOTE [Static graph needs a defined zero]), the nested
# backward through ``_FireHooks`` stays.
# Test: tests/test_reach_protocol.py::test_join_with_a_branch_idle_on_some_ranks_matches_a_single_process.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _reducer_index(ddp: nn.Module, params: list) -> list[int] | None:
    """Each of ``params``' place in the reducer's list, or None where the direct call cannot be used."""
    reducer, build = getattr(ddp, "reducer", None), getattr(ddp, "_build_params_for_reducer", None)
    if not hasattr(reducer, "_autograd_hook") or build is None:
        return None
    try:
        place = {id(p): i for i, p in enumerate(build()[0])}  # (parameters, expect_sparse_gradient)
    except Exception:  # noqa: BLE001 - a private helper of another shape: keep the nested backward
        return None
    index = [place.get(id(p)) for p in params]
    return None if None in index or len(place) != len(params) else index


# NOTE [Static graph needs a defined zero]
# Invariant: under static_graph, a parameter fired without a gradient still gets its averaged gradient written
# every step. The reducer decides in its first iteration which parameters are unused, from the gradients that are
# *defined* when their hooks fire, and never again: one first seen with an undefined gradient is treated as unused
# in every later step, its average is never written back, and the ranks drift apart without an error.
# Rule: under static_graph the fired hook carries a real zero, so the parameter counts as used in every iteration.
# ``static_graph`` is read when the backward ends, not when the DDP was built: ``ddp._set_static_graph()`` after
# construction is common ("to allow checkpointing").
# Test: tests/test_reach.py::test_static_graph_set_after_construction_is_correct.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7


def needed(ddp: nn.Module) -> bool:
    """Only a reducer that does not search for unused parameters itself needs the rescue. Read per forward."""
    return not ddp.find_unused_parameters or bool(getattr(ddp, "static_graph", False))


# NOTE [Unused parameters without find_unused_parameters]
# Invariant: where the reducer does not search for unused parameters itself (find_unused_parameters=False, or
# static_graph), every trainable parameter fires its DDP hook exactly once per synced backward, whatever the data
# (a tower on a text-only batch, an idle expert, a branch not taken, a tower under no_grad). Otherwise the reducer
# raises "Expected to have finished reduction in the prior iteration" (gloo) or hangs (NCCL), and static_graph
# rejects a graph that changes. The DDP settings stay the user's: find_unused_parameters=True costs every step and
# breaks patterns that work without it (accelerate's ``trigger_sync_in_backward``, PowerSGD).
# Rule: a post-hook on each parameter's AccumulateGrad node records that it ran, in any graph task (nested
# reentrant ones included). ``_BackwardStart``, an identity on the outputs above DDP's ``_DDPSink``, queues
# ``_settle`` as the backward's first final callback, so it runs after every nested backward. ``_settle`` fires
# each parameter whose node did not run, with no gradient (DDP's hook marks it ready with a zero slot, as
# reducer.cpp allows) or with a defined zero under static graph: the average over ranks is what
# find_unused_parameters=True gives. Where it fires: NOTE [Unused parameters marked where DDP marks them].
# Test: tests/test_reach.py::test_a_layer_that_runs_and_feeds_nothing_trains_with_ddp_defaults.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
class UnusedParameterEdges:
    """Per DDP instance: make each trainable parameter's hook fire once per synced backward."""

    def __init__(self, ddp: nn.Module) -> None:
        ignored = getattr(ddp, "parameters_to_ignore", set())
        seen: set[int] = set()
        self._names: list[str] = []
        self._params: list[nn.Parameter] = []
        for name, p in ddp.module.named_parameters():  # deduplicated, as DDP's own list
            if p.requires_grad and name not in ignored and id(p) not in seen:
                seen.add(id(p))
                self._names.append(name)
                self._params.append(p)
        self._fired: set[int] = set()  # indices of parameters whose AccumulateGrad ran since the last settle
        self._fired_empty: set[int] = set()  # of those, the ones whose node ran with no gradient and had none
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._node_hooks: list[Any] = []
        # The parameters' AccumulateGrad nodes, the ones DDP's reducer took and hooked a moment ago: taken now,
        # while every listed parameter is trainable (a first forward under PEFT's disable_adapter() has them frozen,
        # and a frozen parameter has no gradient edge to take).
        self._nodes: list[Any] = [get_gradient_edge(p).node for p in self._params]
        self._reducer_index = _reducer_index(ddp, self._params)  # NOTE [Firing many hooks at once]
        self._reducer_index_is_identity = self._reducer_index == list(range(len(self._params)))
        self._active = False
        # The DDP whose forward awaits its settle: NOTE [One collective per reduction, on every rank].
        # The post-hooks' fast path (``_Recorder``) while neither of the two below is set: [True] then.
        self._quiet = [True]
        self._armed_ref: weakref.ref | None = None
        self._pending_reset: torch.Tensor | None = None  # indices of the parameters unused on every rank
        self._finalized_in_backward = False  # torch >= 2.15 manual finalization ran from a backward hook
        self._retired = False
        self.attached_last = 0  # parameters fired by the last settle (tests, the doctor)
        self._settling_task = -1  # the graph task whose end settles (one settle per backward)
        # Fired at the start of this backward: NOTE [Unused parameters marked where DDP marks them].
        self._early: list[int] = []
        self._early_no_grad: list[int] = []  # of those, the ones without a gradient before they fired
        self._graph: GraphFacts | None = None  # what the walk at the start of this backward found
        self._starts: list[tuple] = []  # per forward since the last settle, its outputs' _BackwardStart nodes (weakly)
        self._culprit: str | None = None  # the custom Function that kept the last late fire for the end
        self._deferred = False  # the last settle left its missing parameters to a later backward of the forward
        self._by_settle: frozenset[int] = frozenset()  # fired empty by the last settle, until the next forward

    def __getstate__(self) -> dict:
        # A DDP is pickled or deep-copied with its forward hooks (PyTorch's own DDP tests do it): the copy keeps
        # the parameter list and watches its own nodes again at its first forward.
        state = dict(self.__dict__)
        state.update(_fired=set(), _fired_empty=set(), _node_hooks=[], _nodes=[], _active=False,
                     _armed_ref=None, _quiet=[True], _settling_task=-1,
                     _pending_reset=None, _finalized_in_backward=False, _early=[], _early_no_grad=[], _graph=None,
                     _starts=[], _deferred=False, _by_settle=frozenset())
        return state

    @property
    def _armed(self) -> weakref.ref | None:
        """The DDP whose forward awaits its settle: NOTE [One collective per reduction, on every rank]."""
        return self._armed_ref

    @_armed.setter
    def _armed(self, ref: weakref.ref | None) -> None:
        self._armed_ref = ref
        self._quiet[0] = ref is None and not self._by_settle

    @property
    def _fired_by_settle(self) -> frozenset[int]:
        """Fired empty by the last settle, until the next forward: NOTE [A backward after the reduction]."""
        return self._by_settle

    @_fired_by_settle.setter
    def _fired_by_settle(self, fired: frozenset[int]) -> None:
        self._by_settle = fired
        self._quiet[0] = self._armed_ref is None and not fired

    def install(self, ddp: nn.Module) -> None:
        REGISTRY.add_instance_handle(ddp.register_forward_pre_hook(self._begin))
        REGISTRY.add_instance_handle(ddp.register_forward_hook(self._attach))

    def remove(self) -> None:
        """Retire: no more node hooks, and no more acting (a newer DDP wraps the same module)."""
        for handle in self._node_hooks:
            handle.remove()
        self._node_hooks.clear()
        self._nodes.clear()
        self._retired = True

    def _watch_nodes(self) -> None:
        """Post-hooks on the AccumulateGrad nodes, once, at the first forward that needs them."""
        if not self._nodes:  # a copy (__getstate__) takes its own nodes at its first forward
            self._nodes = [get_gradient_edge(p).node for p in self._params]
        for i, node in enumerate(self._nodes):
            handle = node.register_hook(_Recorder(self, i))
            self._node_hooks.append(handle)
            REGISTRY.add_instance_handle(handle)

    def reached_empty(self, index: int) -> None:
        """Parameter ``index``'s node runs with no gradient (a Function returned None for it): counted as a
        parameter without a gradient here where it had none before (NOTE [Unused everywhere ends with grad None])."""
        if self._params[index].grad is None:
            self._fired_empty.add(index)

    def _begin(self, ddp, args) -> None:
        if self._retired:
            log_rank0_once("retired-edges", logging.WARNING,
                           "ddp_patches: a DistributedDataParallel runs whose module a newer one wraps; only the newest "
                           "is protected against parameters without a gradient (ddp_patches.rescue.edges.install)")
        # Under dynamo the outputs cannot be wrapped (no autograd graph while tracing): step aside (NOTE [Engines]).
        self._active = (not self._retired and torch.is_grad_enabled() and needed(ddp)
                        and not engines.compiling())
        if self._deferred:
            self._deferred = False
            self._report_backward_never_came()
        self._fired_by_settle = frozenset()
        if self._active:
            if not self._node_hooks:
                self._watch_nodes()
            self._fired.clear()
            self._fired_empty.clear()
            self._armed = weakref.ref(ddp)  # DDP prepares its reducer in this forward: one settle will follow

    def _report_backward_never_came(self) -> None:
        missing = [self._names[i] for i in range(len(self._params)) if i not in self._fired]
        self._fired.clear()
        self._fired_empty.clear()
        self._early_no_grad, self._starts = [], []
        log_rank0_once("deferred-never-came", logging.WARNING,
                       "ddp_patches: the last forward's outputs lead to %d trainable parameter(s) (e.g. %s) that no "
                       "backward reached, and no backward ran through those outputs before this forward: their DDP "
                       "hooks were left to that backward, so DDP's reduction of the last step is unfinished, as "
                       "without the library (NOTE [Several backwards of one forward] in ddp_patches/rescue/edges.py)",
                       len(missing), missing[0] if missing else "?")

    def _attach(self, ddp, args, output):
        if not self._active:
            return None
        self._active = False
        return map_tensors(output, _is_graph_output, lambda ts: self._start_nodes(ddp, ts))

    def _start_nodes(self, ddp: nn.Module, tensors: list) -> tuple:
        """One ``_BackwardStart`` per output (NOTE [Several backwards of one forward])."""
        outputs = tuple(_BackwardStart.apply(self, ddp, t) for t in tensors)
        # Every forward's start nodes until the settle (weakly: a discarded output frees its graph): the walks must
        # see below all of them, a second forward of this DDP in the same loss included.
        if len(self._starts) >= 8:  # forwards with grad and no backward (a detached reference output) add up
            self._starts = [refs for refs in self._starts if any(ref() is not None for ref in refs)]
        self._starts.append(tuple(weakref.ref(t.grad_fn) for t in outputs))
        return outputs


    def backward_started(self, ddp: nn.Module, node: Any = None) -> None:
        """A backward through the outputs began (``_BackwardStart``; ``node`` is that node)."""
        # Two forwards of one DDP feeding one loss (a GAN's discriminator on real and fake data, a multi-task loss)
        # start this twice in one graph task: settle once, or the second settle sees an empty record and fires
        # every hook again ("marked as ready twice").
        if self._armed is None:
            if getattr(node, "settled_by_fire", False):
                self._refuse_a_backward_after_a_fired_settle(node)
            return
        if torch._C._current_graph_task_id() == self._settling_task:
            node.ran = True
            return
        if _in_autograd_grad(self._nodes):
            return  # NOTE [Only a backward that accumulates]
        node.ran = True  # this output's backward came: NOTE [Several backwards of one forward]
        self._queue_settle(ddp)
        if node is not None and _reducer_prepared(ddp):
            self._fire_unreachable(ddp, node)

    def _refuse_a_backward_after_a_fired_settle(self, node: Any) -> None:
        """NOTE [A backward after the reduction]: DDP alone would raise "marked ready twice" here."""
        if _in_autograd_grad(self._nodes) or not any(map(torch._C._will_engine_execute_node, self._nodes)):
            return  # accumulates nothing: the reducer is not involved
        raise RuntimeError(
            "ddp_patches: a second backward runs through outputs of a DistributedDataParallel forward whose "
            "gradients were already reduced in an earlier backward, in which some trainable parameter got no "
            "gradient on this rank and fired its DDP hook empty. DDP alone raises \"Expected to mark a variable "
            "ready only once\" here; its reducer now ignores these gradients, so they would stay unaveraged. Sum the "
            "losses into one backward, or run a forward per backward (NOTE [A backward after the reduction] in "
            "ddp_patches/rescue/edges.py).")

    def _refuse_a_gradient_after_the_reduction(self, index: int) -> None:
        """NOTE [A backward after the reduction], for a backward that does not pass the DDP's outputs."""
        raise RuntimeError(
            f"ddp_patches: trainable parameter '{self._names[index]}' gets a gradient in a backward that runs after "
            "its DistributedDataParallel finished the forward's reduction: the backward before did not reach it on "
            "this rank, so its DDP hook was fired with no gradient, and the reducer would now ignore this gradient "
            "(unaveraged). Without the library DDP waits for it here. Compute that loss before the first backward "
            "and sum the losses, or pass find_unused_parameters=True (NOTE [A backward after the reduction] in "
            "ddp_patches/rescue/edges.py).")

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

    def _defer(self, ddp: nn.Module, fired: set, empty: list, early_no_grad: list, starts: list) -> None:
        """NOTE [Several backwards of one forward]: fire nothing now; the backward that leaves no output pending
        settles what is still missing then."""
        self._fired.update(fired)
        self._fired_empty.update(empty)
        self._early_no_grad = early_no_grad + self._early_no_grad
        self._starts = starts + self._starts
        self._armed = weakref.ref(ddp)
        self._deferred = True

    def parameter_accumulated(self, index: int, empty: bool = False) -> None:
        """A post-hook of parameter ``index``'s AccumulateGrad ran (``empty``: with no gradient, as after a
        Function that returned None for it): the reducer saw its hook in this backward. The first one of a
        backward that did not pass the outputs settles it (NOTE [One collective per reduction, on every rank])."""
        self._fired.add(index)
        if empty:
            self.reached_empty(index)
        elif index in self._fired_by_settle:
            self._refuse_a_gradient_after_the_reduction(index)
        if self._armed is not None:
            ddp = self._armed()
            if ddp is not None:
                self._queue_settle(ddp)

    def _queue_settle(self, ddp: nn.Module) -> None:
        task = torch._C._current_graph_task_id()
        # Hooks of parameters on different devices run on different autograd threads: decide once, under a lock.
        # A forward re-run inside this backward (a checkpoint's recompute of the whole DDP) armed again: this
        # backward still settles once.
        with _SETTLE_LOCK:
            self._armed = None
            if task == self._settling_task:
                return
            self._settling_task = task
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._settle(ddp))

    def _settle(self, ddp: nn.Module) -> None:
        fired, early, early_no_grad, graph = set(self._fired), self._early, self._early_no_grad, self._graph
        empty = sorted(self._fired_empty)
        self._fired.clear()
        self._fired_empty.clear()
        self._early, self._early_no_grad, self._graph = [], [], None
        starts, self._starts = self._starts, []
        if not self._params or not _reducer_prepared(ddp):
            return  # a forward under no_sync prepared no reduction: the reducer ignores hooks, nothing to fire
        if not fired and not early:  # NOTE [Only a backward that accumulates]: the forward's reduction is to come
            self._armed = weakref.ref(ddp)
            return
        fired.update(early)
        late = [] if len(fired) == len(self._params) else list(
            itertools.filterfalse(fired.__contains__, range(len(self._params))))
        if late and self._later_backward_may_reach(late, starts, static=_static(ddp)):
            self._defer(ddp, fired, empty, early_no_grad, starts)
            return
        self._deferred = False
        self.attached_last = len(late) + len(early)
        no_grad = early_no_grad + empty
        if late:
            no_grad += itertools.compress(late, map(operator.is_, map(_GRAD, _pick(self._params, late)),
                                                    itertools.repeat(None)))
        if early or late:
            for node in _live(starts):
                node.settled_by_fire = True  # NOTE [A backward after the reduction]
            first = (early or late)[0]
            log_rank0_once("unused-edges", logging.INFO,
                           "ddp_patches: %d trainable parameter(s) got no gradient in this backward (e.g. %s); each "
                           "fires its DDP hook once with no gradient "
                           "(NOTE [Unused parameters without find_unused_parameters] in ddp_patches/rescue/edges.py)",
                           len(early) + len(late),
                           self._names[first])
        context = self._other_collectives(ddp, graph) if late else None
        self._culprit = graph.may_nest if graph is not None else "not walked"
        if late:
            self._fire(ddp, late)
        self._fired_by_settle = frozenset(itertools.chain(early, late))  # after the fire: a static-graph fire accumulates
        # Behind the reducer's finalize (queued by now, or already run in the nested backward above).
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._reset_unused_everywhere(ddp, no_grad, late, context))

    def _other_collectives(self, ddp: nn.Module, graph: GraphFacts | None) -> str | None:
        """What else issues a collective on this DDP's group in this backward, as far as this rank can see."""
        group, task = getattr(ddp, "process_group", None), torch._C._current_graph_task_id()
        if any(e is not self and e._settling_task == task and getattr(d, "process_group", None) is group
               for d, e in list(_instances.items())):
            return "another DistributedDataParallel on the same process group ran in this backward"
        if graph is not None and graph.collectives:
            return f"{graph.collectives[0]} issued a collective in this backward"
        return None

    def _refuse_a_mixed_late_fire(self, late: list[int], late_counts: list[float], world: int, context: str,
                                  may_nest: str | None) -> None:
        """NOTE [Unused parameters marked where DDP marks them]: a parameter fired at the end of the backward here
        but not on every rank had its bucket all-reduced after ``context``'s collective here and before it
        elsewhere: this step's gradients cannot be trusted, so the backward fails before any optimizer step."""
        mixed = [i for i, n in zip(late, late_counts) if n < world]
        if not mixed:
            return  # fired at the end on every rank: the same place in the sequence everywhere
        raise RuntimeError(
            f"ddp_patches: {len(mixed)} trainable parameter(s) of this DistributedDataParallel (e.g. "
            f"'{self._names[mixed[0]]}') got no gradient on this rank, and a custom autograd Function in its graph "
            f"({may_nest}) may reach parameters in a nested backward, so their DDP hooks fired at the end of the "
            f"backward here but earlier on other ranks, while {context}: their buckets may have been all-reduced "
            "with the wrong collective, so this step's gradients are not trusted. Give this DDP its own group "
            "(process_group=torch.distributed.new_group(...)), or pass find_unused_parameters=True, or make the "
            "Function non-reentrant (NOTE [Unused parameters marked where DDP marks them] in "
            "ddp_patches/rescue/edges.py).")

    # NOTE [Unused everywhere ends with grad None]
    # Invariant: a parameter that no rank used in a synced step ends with ``.grad`` None, as with
    # find_unused_parameters=True and in a single process, so AdamW's weight decay and momentum leave it alone.
    # Rule: after the reducer has written its averages (a second callback, queued behind DDP's own finalize), one
    # all-reduce of one float per trainable parameter over the DDP's group counts the ranks on which it had no
    # gradient before ``_settle`` fired it; where that count is the world size, ``.grad`` is set back to None.
    # When it runs: NOTE [One collective per reduction, on every rank].
    # Test: tests/test_reach.py::test_unused_everywhere_ends_with_grad_none_and_adamw_matches_find_unused.
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
    def _reset_unused_everywhere(self, ddp: nn.Module, no_grad: list[int], late: list[int] = (),
                                 context: str | None = None) -> None:
        """NOTE [Unused everywhere ends with grad None]; read back only where this rank had a parameter without
        a gradient (NOTE [One collective per reduction, on every rank]). The second half counts, per parameter, the
        ranks that fired it at the end of the backward (NOTE [Unused parameters marked where DDP marks them])."""
        group = getattr(ddp, "process_group", None)
        world = torch.distributed.get_world_size(group)
        device = self._params[0].device
        no_grad_index = _index_tensor(no_grad, device) if no_grad else None
        counts = _count_tensor(len(self._params), no_grad_index, late, world, device)
        torch.distributed.all_reduce(counts, group=group)
        finalized, self._finalized_in_backward = self._finalized_in_backward, False
        if late and context is not None:  # read back only where a late fire met another collective
            late_counts = (counts[late] // (world + 1)).tolist()
            self._refuse_a_mixed_late_fire(late, late_counts, world, context, self._culprit)
        if not no_grad:
            return  # every parameter had a gradient here, so none is unused everywhere: nothing to read back
        # On the device, read back at the reset: unused on every rank where the count of ranks without it is world.
        self._pending_reset = no_grad_index[torch.remainder(counts[no_grad_index], world + 1) == world]
        if finalized or not getattr(ddp, "_require_manual_backward_finalization", False):
            self.apply_pending_reset()  # else at the user's finalize_backward(): NOTE [Manual finalization]

    def apply_pending_reset(self) -> None:
        if self._pending_reset is None:
            return
        unused_everywhere = self._pending_reset.tolist()
        self._pending_reset = None
        collections.deque(map(_SET_GRAD, _pick(self._params, unused_everywhere), itertools.repeat(None)), 0)

    def backward_finalized(self) -> None:
        """The user called ``finalize_backward()`` (torch >= 2.15, manual finalization): the reducer has written
        the averages now. From a hook inside the backward, the reset follows at its end."""
        if torch._C._current_graph_task_id() != -1:
            self._finalized_in_backward = True
        else:
            self.apply_pending_reset()

    def _fire(self, ddp: nn.Module, missing: list[int]) -> None:
        """Each missing parameter's DDP hook, once, with no gradient (NOTE [Firing many hooks at once])."""
        static = bool(getattr(ddp, "static_graph", False))
        if not static and self._reducer_index is not None:
            index = missing if self._reducer_index_is_identity else _pick(self._reducer_index, missing)
            collections.deque(map(ddp.reducer._autograd_hook, index), 0)
            return
        with torch.enable_grad():
            out = _FireHooks.apply(static, *(self._params[i] for i in missing))
        torch.autograd.backward(out, torch.zeros_like(out))

    def settles(self, ddp: nn.Module) -> bool:
        """Whether a synced backward of ``ddp`` ends with the count-all-reduce: settings equal on every rank."""
        return bool(self._params) and not self._retired and needed(ddp) and not engines.compiling()

    def shadow_in_join(self, ddp: nn.Module) -> None:
        """On a rank that joined: the count-all-reduce its peers issue, with "no gradient here" everywhere."""
        group = getattr(ddp, "process_group", None)
        n = len(self._params)
        counts = _count_tensor(n, slice(None), [], torch.distributed.get_world_size(group), self._params[0].device)
        torch.distributed.all_reduce(counts, group=group)  # no gradient anywhere here; fired late nowhere


# NOTE [One collective per reduction, on every rank]
# Invariant: the count-all-reduce is issued exactly once per reduction DDP itself does, on every rank, after DDP's
# own collectives: a collective one rank issues and another does not pairs with the wrong call (a hang, a gloo
# size error, or with NCCL buffers of equal size mixed silently).
# Rule: a forward after which DDP reduces (grad mode and sync on, or accelerate's ``trigger_sync_in_backward``)
# arms one settle; the FIRST of ``_BackwardStart`` (a backward through the outputs) and a post-hook of the DDP's
# AccumulateGrad nodes (a loss that reaches the parameters but not the outputs, such as
# ``sum(p.sum() for p in params) * 0``) disarms it and settles. Whether it runs is read from what the forward
# decided (below) and from settings equal on every rank (``needed``), never from ``no_sync()`` around the
# backward alone nor from this rank's data.
# Under ``Join``, a rank out of data issues the same all-reduce ("no gradient here" everywhere) right after DDP's
# join hook has shadowed the bucket all-reduces, when the peers synchronise (``_JoinShadow``). The reduced counts
# are read back on the host only by a rank that had a parameter without a gradient.
# Test: tests/test_reach_protocol.py::test_join_with_no_sync_around_the_forward_or_the_backward_only.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _reducer_prepared(ddp: nn.Module) -> bool:
    """Whether the last forward prepared DDP's reducer for a reduction (``require_forward_param_sync``)."""
    return bool(getattr(ddp, "require_forward_param_sync", ddp.require_backward_grad_sync))


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


class _Recorder:
    """AccumulateGrad post-hook: parameter ``index`` ran (any graph task, nested included)."""

    __slots__ = ("edges", "index", "record", "quiet")

    def __init__(self, edges: UnusedParameterEdges, index: int) -> None:
        self.edges, self.index = weakref.proxy(edges), index  # the node must not keep a retired DDP's edges alive
        # A gradient with nothing armed and nothing fired by a settle is only recorded: one set.add, no lookups.
        self.record, self.quiet = edges._fired.add, edges._quiet

    def __call__(self, grad_inputs, grad_outputs) -> None:
        if self.quiet[0] and grad_outputs[0] is not None:
            self.record(self.index)
            return
        try:
            self.edges.parameter_accumulated(self.index, grad_outputs[0] is None)
        except ReferenceError:  # edges gone with their DDP; the hook is removed with them soon
            pass


class _JoinShadow(JoinHook):
    """DDP's join hook, followed by the count-all-reduce its peers issue
    (NOTE [One collective per reduction, on every rank])."""

    def __init__(self, inner: JoinHook, ddp: nn.Module, edges: UnusedParameterEdges) -> None:
        self.inner, self.ddp, self.edges = inner, ddp, edges

    def main_hook(self) -> None:
        self.inner.main_hook()
        # DDP's main_hook has just learnt from the peers' forward whether they synchronise this backward.
        if _reducer_prepared(self.ddp) and self.edges.settles(self.ddp):
            self.edges.shadow_in_join(self.ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.inner.post_hook(is_last_joiner)


def _patched_join_hook(original_join_hook):
    def join_hook(self, **kwargs):
        hook = original_join_hook(self, **kwargs)
        edges = for_ddp(self)
        return hook if edges is None else _JoinShadow(hook, self, edges)

    return join_hook


# NOTE [Manual finalization]
# torch 2.15's ``ddp.require_manual_backward_finalization = True`` leaves the reducer's write-back of the averaged
# gradients to the user's ``ddp.finalize_backward()``, after the backward returns (or from a hook once every bucket
# is ready). The count-all-reduce is still issued at the end of the backward, in the same place in the sequence of
# collectives, but setting ``.grad = None`` before the write-back would be undone by it: so the reset waits for
# ``finalize_backward()`` (wrapped on the class), or runs at the end of the backward when a hook already called it.
# Test: tests/test_reach_protocol.py::test_torch_2_15_ddp_options_with_a_parameter_no_rank_used.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def _patched_finalize_backward(original_finalize_backward):
    def finalize_backward(self):
        original_finalize_backward(self)
        edges = for_ddp(self)
        if edges is not None:
            edges.backward_finalized()

    return finalize_backward


def patch_finalize_backward() -> list[str]:
    """Where DDP has manual backward finalization (torch >= 2.15)."""
    from torch.nn.parallel import DistributedDataParallel

    if "finalize_backward" not in vars(DistributedDataParallel):
        return []
    REGISTRY.install(DistributedDataParallel, "finalize_backward", _patched_finalize_backward)
    return ["DistributedDataParallel.finalize_backward"]


def patch_join_hook() -> list[str]:
    """``DistributedDataParallel.join_hook`` also shadows the count-all-reduce on a joined rank."""
    from torch.nn.parallel import DistributedDataParallel

    REGISTRY.install(DistributedDataParallel, "join_hook", _patched_join_hook)
    return ["DistributedDataParallel.join_hook"]


def _is_graph_output(t: Any) -> bool:
    # Not a leaf: a parameter returned as an output stays itself (its own hook fires), not a detached alias.
    return isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None


# NOTE [Outputs found as DDP finds them]
# DDP's ``_find_tensors`` looks into tensors, lists, tuples, dicts and dataclasses; pytree alone sees a plain
# @dataclass as one leaf without tensors. So pytree takes what it knows (tuples, namedtuples, dicts, transformers'
# ModelOutput), and a dataclass leaf is looked into field by field (in place: its fields are what the caller
# reads; a frozen one too).
# Test: tests/test_reach.py::test_dataclass_outputs_are_rescued.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §7
def map_tensors(output: Any, select: Callable[[Any], bool], apply: Callable[[list], tuple]) -> Any:
    """Replace the tensors ``select`` picks in ``output`` with ``apply(all of them)``'s results, in order."""
    slots: list[tuple[Any, ...]] = []  # ("leaf", index) or ("field", obj, name)
    leaves, spec = pytree.tree_flatten(output)
    for i, leaf in enumerate(leaves):
        if select(leaf):
            slots.append(("leaf", i))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            _dataclass_slots(leaf, select, slots, depth=0)
    if not slots:
        return None
    found = [leaves[s[1]] if s[0] == "leaf" else getattr(s[1], s[2]) for s in slots]
    for slot, new in zip(slots, apply(found)):
        if slot[0] == "leaf":
            leaves[slot[1]] = new
        else:
            object.__setattr__(slot[1], slot[2], new)
    return pytree.tree_unflatten(leaves, spec)


def _dataclass_slots(obj: Any, select, slots: list, depth: int) -> None:
    if depth > 8:
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if select(value):
            slots.append(("field", obj, f.name))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _dataclass_slots(value, select, slots, depth + 1)


def install(ddp: nn.Module) -> UnusedParameterEdges:
    """Attach the per-forward bookkeeping to ``ddp`` (it acts only in forwards where ``needed``).

    A module wrapped again (a new DDP per phase, or per call in a loop) keeps one set of node hooks, the newest
    DDP's: the older one's are removed, so wrapping 31 times does not leave 31 Python hooks per parameter.
    """
    previous = _by_module.get(ddp.module)
    if previous is not None:
        previous.remove()
    edges = UnusedParameterEdges(ddp)
    edges.install(ddp)
    _instances[ddp] = edges
    _by_module[ddp.module] = edges
    return edges


def _count_tensor(n: int, no_grad: torch.Tensor | slice | None, late, world: int, device) -> torch.Tensor:
    """Per parameter: 1 where it had no gradient here, plus world + 1 where it fired late here. After the sum over
    ranks, ``value % (world + 1)`` counts the ranks without a gradient and ``value // (world + 1)`` the late ones;
    float32 holds both exactly while (world + 1)^2 < 2^24, float64 beyond."""
    counts = torch.zeros(n, dtype=torch.float32 if world < 4000 else torch.float64, device=device)
    if no_grad is not None:
        counts[no_grad] = 1.0
    if late:
        counts[torch.tensor(late, device=device)] += float(world + 1)
    return counts


def needs_defined_zero(param: torch.Tensor) -> bool:
    """Whether a Function with no gradient for ``param`` must still give it a defined zero: a DDP with
    static_graph trains it (NOTE [Static graph needs a defined zero]). The parameter then ends with a zero
    gradient: the engine sums that zero with whatever else reaches the parameter in the same backward, so it
    cannot be told from a real one and is never reset to None (a shared weight used elsewhere keeps its gradient).
    The tiled MLP asks, for a parameter no shard used."""
    for ddp, edges in list(_instances.items()):
        index = edges._index.get(id(param))
        if index is not None and not edges._retired and getattr(ddp, "static_graph", False):
            return True
    return False


def for_ddp(ddp: nn.Module) -> UnusedParameterEdges | None:
    """The bookkeeping installed on ``ddp``."""
    return _instances.get(ddp)


_instances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrapped module -> its newest bookkeeping


# -- what the rescue assumes (NOTE [Probed assumptions] in ddp_patches/probes.py) --------------------------------
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


def _check_autograd_hooks() -> None:
    """A post-hook on a leaf's AccumulateGrad node runs in its backward; a final callback queued from a Function's
    backward runs after it, in the same graph task, and can run a nested backward that fires another node's hook
    with no gradient, leaving that leaf's .grad None (what ``_settle`` does)."""
    from ..probes import expect

    p, q = (torch.ones(2, dtype=torch.float32, requires_grad=True) for _ in range(2))
    events: list = []
    p_node, q_node = get_gradient_edge(p).node, get_gradient_edge(q).node
    handles = [p_node.register_hook(lambda gi, go: events.append("p")),
               q_node.register_hook(lambda gi, go: events.append("q"))]

    def settle(will_run, task):
        events.append(("callback", will_run, task == torch._C._current_graph_task_id() != -1))
        with torch.enable_grad():
            out = _FireHooks.apply(False, q)
        out.backward()  # no explicit gradient: that path imports sympy (0.5 s at apply())

    try:
        (_ProbeStart.apply(settle, p_node, p * 2)).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    expect(events == ["p", ("callback", True, True), "q"],
           f"hooks and final callback ran as {events}, expected p's hook, the callback in that task, q's hook")
    expect(q.grad is None and torch.equal(p.grad, torch.full((2,), 2.0, dtype=torch.float32)),
           "a hook fired with no gradient wrote one")


def _check_join_hook() -> None:
    """DDP's join hook shadows a backward's bucket all-reduces in ``main_hook`` and records there whether the
    peers synchronise it (what ``_JoinShadow`` reads)."""
    from torch.nn.parallel import distributed

    probes.source_mentions(distributed, "def join_hook", "class _DDPJoinHook", "def main_hook",
                           "require_forward_param_sync = should_sync_backwards")


ASSUMPTIONS = (
    probes.Assumption("join-hook", "DistributedDataParallel.join_hook returns a JoinHook whose main_hook sets "
                      "require_forward_param_sync (NOTE [One collective per reduction, on every rank])",
                      _check_join_hook),
    probes.Assumption("autograd-hooks", "AccumulateGrad post-hooks, torch._C._current_graph_task_id, "
                      "torch._C._will_engine_execute_node and final callbacks queued from a backward run as "
                      "NOTE [Unused parameters without find_unused_parameters] describes", _check_autograd_hooks),
)
