"""Every trainable parameter's DDP hook fires exactly once per synced backward, whatever the data.

``install(ddp)`` attaches ``UnusedParameterEdges`` to a DDP built under apply(); where the reducer does not search
for unused parameters itself (``needed``), a parameter without a gradient fires its hook with none, and one that no
rank used ends with ``.grad`` None (NOTE [Unused parameters without find_unused_parameters]).
The graph walk is in ``graph``, the count-all-reduce in ``counts``, Join and manual finalization in ``join``;
``needs_defined_zero`` and ``for_ddp`` serve the tiled MLP and the other reducer patches.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .. import engines
from .._registry import REGISTRY
from ..distributed import log_rank0_once
from .counts import CountAllReduce, _pick, _reducer_prepared, needed
from .graph import _GRAD, GraphFacts, UnreachedAtStart, _in_autograd_grad, _live, _static
from .outputs import _is_graph_output, map_tensors

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
class UnusedParameterEdges(UnreachedAtStart, CountAllReduce):
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
