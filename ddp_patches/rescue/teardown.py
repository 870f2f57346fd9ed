"""A DDP's reducer and its process group are released when the group is destroyed, not at exit.

``install()`` patches ``torch.distributed.destroy_process_group``: before the group goes, every DDP built under
apply() on it (``track``) is ``release``d to a ``ReleasedReducer`` stand-in; afterwards torch's default arguments
that still hold the dead group are cleared (``forget_dead_groups_in_defaults``). It also registers a short pause
at exit (``pause_for_collective_workers``); ``revert()`` undoes both.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .. import probes, versions
from .._registry import REGISTRY
from ..distributed import world_is_distributed

logger = logging.getLogger("ddp_patches")

TARGETS = ("torch.distributed.destroy_process_group",)

_live: weakref.WeakSet = weakref.WeakSet()
_was_distributed: list[bool] = []  # set once a patched destroy_process_group saw world size > 1


def _destroyed(what: str) -> str:
    return (f"ddp_patches: {what}, but this DistributedDataParallel's process group was destroyed "
            "(torch.distributed.destroy_process_group, e.g. by trainer.end()), and its reducer was released with it "
            "(NOTE [Reducer outliving its process group] in ddp_patches/rescue/teardown.py). To train again, call "
            "init_process_group and wrap the model in a new DistributedDataParallel.")


SYNCED_BACKWARD = _destroyed(
    "a backward reached the parameters of a DistributedDataParallel after a forward through it with gradient sync "
    "on, so DDP would all-reduce their gradients; none was written") + (
    " For local gradients, run the forward through ddp.module or under ddp.no_sync(); the gradient of an output "
    "w.r.t. the input (torch.autograd.grad(output, inputs)) needs no collective and works as it is "
    "(NOTE [A DDP after its group was destroyed]).")

BUFFER_BROADCAST = _destroyed(
    "this DistributedDataParallel would broadcast its buffers (e.g. BatchNorm running statistics) from rank 0 "
    "before this forward") + (
    " To evaluate with this rank's own buffers, call ddp.module(...); to get rank 0's, evaluate before "
    "destroy_process_group.")


# NOTE [A DDP after its group was destroyed]
# Invariant: a released DDP still does, as the plain module would, all that needs no collective: state_dict(),
# evaluation with or without grad mode, ``autograd.grad`` of an output w.r.t. the input, local accumulation under
# no_sync(). Only a real collective fails, and then clearly, never silently.
# Rule: ``ReleasedReducer`` stands in for the reducer and the logger. It answers what DDP's forward asks without a
# collective (``prepare_for_forward``, ``_rebuild_buckets`` -> False, ``set_error_and_log`` so DDP's own error is
# raised) and raises, naming it, for anything that configures or runs communication. A backward must be refused
# because ~Reducer removed its AccumulateGrad hooks: a synced backward would write local, unaveraged gradients
# without a word. So ``prepare_for_backward`` arms, as it armed the reducer, a pre-hook on each trainable
# parameter's AccumulateGrad node that raises before anything accumulates and disarms, as the finished reduction
# would (``autograd.grad`` runs no such node: NOTE [Only a backward that accumulates]). DDP's buffer broadcast
# would hand C++ a None group (a segfault): on the instance it becomes a clear error. A new DDP on the same module
# retires the stand-in's hooks (``track``).
# Test: tests/test_teardown.py::test_evaluation_and_input_gradients_after_destroy_match_the_unpatched_run.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §10
class ReleasedReducer:
    """Stands in for ``DistributedDataParallel.reducer`` and ``.logger`` once their process group was destroyed:
    answers what a forward asks without a collective, and refuses a backward DDP would all-reduce
    (NOTE [A DDP after its group was destroyed])."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = params
        self._nodes: list = []  # the parameters' AccumulateGrad nodes once armed, held as the reducer held them
        self._handles: list = []
        self._armed = False  # the reducer's expect_autograd_hooks_
        self._refused_task = -2  # the graph task of the last refusal (-1 is "no backward running")
        self._retired = False

    # -- what DDP's forward asks (torch 2.13 _pre_forward / _post_forward, _log_and_throw) ---------------------
    def set_runtime_stats_and_log(self) -> None:
        pass

    def prepare_for_forward(self) -> None:
        pass

    def _rebuild_buckets(self) -> bool:
        return False  # no reducer, no buckets: nothing rebuilt, nothing broadcast

    def prepare_for_backward(self, outputs) -> None:
        self._hook_nodes()
        self._armed = not self._retired

    def set_error_and_log(self, message: str) -> None:
        pass  # DDP raises its own error right after

    # -- a backward DDP would all-reduce ---------------------------------------------------------------------
    def _hook_nodes(self) -> None:
        """A pre-hook on each parameter's AccumulateGrad node, once, at the first forward that arms."""
        if self._handles or self._retired:
            return
        refuse = _RefuseSyncedBackward(weakref.ref(self))
        for p in self._params:
            if not p.requires_grad:
                continue
            node = get_gradient_edge(p).node
            self._nodes.append(node)
            handle = node.register_prehook(refuse)
            self._handles.append(handle)
            REGISTRY.add_instance_handle(handle)

    def refuse_if_synced(self) -> None:
        """Raise in the backward DDP would all-reduce: the first to reach the parameters after a synced forward.
        It disarms, as that backward's finished reduction would have; the rest of its graph task is refused too."""
        task = torch._C._current_graph_task_id()
        if self._armed or task == self._refused_task:
            self._armed = False
            self._refused_task = task
            raise RuntimeError(SYNCED_BACKWARD)

    def retire(self) -> None:
        """A newer DDP wraps these parameters: its reducer, not this stand-in, decides about their gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()
        self._armed = False
        self._retired = True

    def shares_parameters_with(self, module: nn.Module) -> bool:
        mine = {id(p) for p in self._params}
        return any(id(p) in mine for p in module.parameters())

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe dunders: not ours to answer
            raise AttributeError(name)
        raise RuntimeError(_destroyed(f"DistributedDataParallel asked its reducer for {name!r}, which needs the "
                                      "process group"))


class _RefuseSyncedBackward:
    """Pre-hook of an AccumulateGrad node: a backward that would accumulate into it is one DDP all-reduces."""

    def __init__(self, stand_in: "weakref.ref[ReleasedReducer]") -> None:
        self.stand_in = stand_in

    def __call__(self, grad_outputs):
        stand_in = self.stand_in()
        if stand_in is not None:  # a freed DDP's reducer would have removed its hooks: nothing to refuse
            stand_in.refuse_if_synced()
        return None


def _refuse_buffer_broadcast(*args, **kwargs):
    raise RuntimeError(BUFFER_BROADCAST)


_released: weakref.WeakSet = weakref.WeakSet()  # stand-ins whose parameters a newer DDP may wrap


def _trainable(ddp: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP's reducer hooked (its _build_params_for_reducer): trainable, not ignored, once each."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]


def track(ddp: nn.Module) -> None:
    """Remember a DDP built under apply(), weakly; retire the refusal of released DDPs on the same parameters."""
    _live.add(ddp)
    for stand_in in list(_released):
        if stand_in.shares_parameters_with(ddp.module):
            stand_in.retire()
            _released.discard(stand_in)


# NOTE [Reducer outliving its process group]
# Invariant: a DDP's reducer never holds the last reference to its process group. pybind11 frees a ``Reducer``
# with the GIL held; if ~Reducer drops the group's last reference, ~ProcessGroupGloo joins its worker threads
# while one may still be freeing a finished ``AsyncAllgatherWork`` whose tensor decref needs the GIL: a deadlock.
# torch's own Python handle of the group releases the GIL before its destructor; the Reducer's holder does not.
# It happens whenever a DDP outlives ``destroy_process_group`` (``trainer.end()`` calls it while the Trainer
# still holds the DDP).
# Rule: just before a group is destroyed, every DDP built under apply() on it drops its reducer and logger while
# the group registry and ``ddp.process_group`` still reference the group, then drops ``process_group``: the group
# is freed afterwards, through its GIL-releasing handle. NOTE [A DDP after its group was destroyed] says what the
# DDP can then still do.
# Test: tests/test_reducer.py::test_destroying_the_group_releases_the_reducer_first.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §10
def release(ddp: nn.Module) -> None:
    """Free the reducer while its group is referenced elsewhere, then drop the DDP's own group reference.

    The order is the fix: NOTE [Reducer outliving its process group]. What the DDP can still do:
    NOTE [A DDP after its group was destroyed].
    """
    stand_in = ReleasedReducer(_trainable(ddp))
    ddp.reducer = ddp.logger = stand_in
    ddp.process_group = None
    ddp._distributed_broadcast_coalesced = _refuse_buffer_broadcast  # never hand None to the C++ broadcast
    _released.add(stand_in)


# NOTE [Groups held by default arguments]
# Invariant: a destroyed default group is freed inside destroy_process_group, not kept to interpreter exit. Some
# torch modules write ``group=group.WORLD`` in a signature (torch.distributed.nn.functional, which DDP's
# constructor imports lazily; ZeroRedundancyOptimizer's _broadcast_object; ShardedGradScaler); imported while a
# default group exists, each such default holds that group for the life of the process. Its gloo workers then
# live to exit, where one still freeing a finished allgather asks for the GIL during finalization and the process
# aborts after a completed run ("terminate called without an active exception").
# Rule: after the group is destroyed, every default argument of GROUP_DEFAULT_MODULES' functions (those already
# imported) that holds a group no longer registered is set to None, which torch.distributed reads as the default
# group at call time. One-way: revert() puts no dead group back (it would fail a later call, or run it on the
# destroyed group). Not covered, as without the library: an instance holding the group itself (a live
# ZeroRedundancyOptimizer's ``self.process_group``); NOTE [A pause at exit] covers what is left.
# Test: tests/test_reducer.py::test_destroyed_default_group_is_freed_not_kept_by_default_arguments.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §10
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer",
                         "torch.distributed.fsdp.sharded_grad_scaler")


def forget_dead_groups_in_defaults() -> int:
    """Set to None every default argument of GROUP_DEFAULT_MODULES' functions (and their classes' methods) that
    holds a process group no longer registered; the number replaced."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _world

    alive = set(map(id, _world.pg_map))

    def dead(value) -> bool:
        return isinstance(value, ProcessGroup) and id(value) not in alive

    replaced = 0
    for name in GROUP_DEFAULT_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for function in _functions_of(module):
            if function.__defaults__ and any(dead(v) for v in function.__defaults__):
                replaced += sum(dead(v) for v in function.__defaults__)
                function.__defaults__ = tuple(None if dead(v) else v for v in function.__defaults__)
            if function.__kwdefaults__ and any(dead(v) for v in function.__kwdefaults__.values()):
                replaced += sum(dead(v) for v in function.__kwdefaults__.values())
                function.__kwdefaults__ = {k: None if dead(v) else v for k, v in function.__kwdefaults__.items()}
    return replaced


def _functions_of(module):
    """The plain functions a module defines, and those of the classes it defines."""
    for value in list(vars(module).values()):
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for member in list(vars(value).values()):
                member = getattr(member, "__func__", member)  # staticmethod / classmethod
                if inspect.isfunction(member):
                    yield member


def _uses(ddp: nn.Module, group) -> bool:
    if group is None:  # the default group: everything goes with it (destroy_process_group() destroys all)
        return True
    return getattr(ddp, "process_group", None) is group


# NOTE [A pause at exit]
# Invariant: a finished collective whose tensors Python already dropped (temporaries, as accelerate's gather and
# TRL's metrics pass) does not abort the process at exit. The gloo worker frees those tensors after the caller's
# wait() returned, and needs the GIL for it; if the main thread reaches interpreter finalization first, the
# worker is told to exit and the process aborts.
# Rule: in a process that was distributed, an atexit callback sleeps EXIT_PAUSE_S (atexit runs before
# finalization, and a sleep releases the GIL), twice the pause measured to suffice; revert() unregisters it. It
# and the patched destroy_process_group ask world_is_distributed(), never is_distributed(), whose first call runs
# the on-first callbacks (a dynamo import) that a script shutting down must not pay. It cannot help a collective
# still running at exit (async_op=True, never waited).
# Test: tests/test_reducer.py::test_a_finished_collective_does_not_abort_the_exit.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §10
EXIT_PAUSE_S = 0.1


def pause_for_collective_workers() -> None:
    """The atexit callback of NOTE [A pause at exit]."""
    if _was_distributed or world_is_distributed():
        time.sleep(EXIT_PAUSE_S)


class _AtExit:
    """A removable atexit registration (REGISTRY handles are removed by revert())."""

    def __init__(self, callback) -> None:
        self.callback = callback
        atexit.register(callback)

    def remove(self) -> None:
        atexit.unregister(self.callback)


# NOTE [Freeing a group needs a GIL-free destructor]
# Invariant: on torch < 2.8 too, freeing a group inside destroy_process_group does not deadlock. The notes above
# free it through its GIL-releasing handle, which torch 2.8 added (pytorch#154976); before it, the last decref
# runs ~ProcessGroupGloo with the GIL held, and its join waits for a worker that waits for the GIL to free a
# finished collective (the deadlock of NOTE [Reducer outliving its process group]). Releasing the reducer first
# moves that last decref into destroy_process_group, where a DDP alive to exit had hidden it.
# Rule: where ``versions.group_destructor_holds_gil()``, the patched destroy_process_group first sleeps
# EXIT_PAUSE_S (the workers finish freeing meanwhile), as the pause at exit does; apply()'s report names it. A
# pause, not a proof: a worker descheduled for longer can still deadlock, as without the library.
# Test: tests/test_reducer.py::test_teardown_pauses_before_freeing_a_group_where_its_destructor_holds_the_gil.
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §10
def _patched_destroy_process_group(original):
    def destroy_process_group(group=None, *args, **kwargs):
        if world_is_distributed():
            _was_distributed[:] = [True]
            if versions.group_destructor_holds_gil():
                time.sleep(EXIT_PAUSE_S)  # NOTE [Freeing a group needs a GIL-free destructor]
        if dist.is_initialized():
            for ddp in list(_live):
                if _uses(ddp, group):
                    release(ddp)
                    _live.discard(ddp)  # released once: a later destroy_process_group() leaves it alone
                    logger.debug("ddp_patches: released a DDP reducer before destroy_process_group")
        result = original(group, *args, **kwargs)
        try:
            if forget_dead_groups_in_defaults():
                logger.debug("ddp_patches: dropped destroyed process groups held by torch default arguments")
        except (AttributeError, ImportError, TypeError) as exc:  # a torch without these internals: leave them
            logger.debug("ddp_patches: default arguments holding process groups left as they are (%s)", exc)
        return result

    return destroy_process_group


def _patch_destroy_process_group() -> None:
    REGISTRY.install(dist, "destroy_process_group", _patched_destroy_process_group)


def _check_signature() -> None:
    import inspect

    params = list(inspect.signature(dist.destroy_process_group).parameters)
    probes.expect(params[:1] == ["group"], f"destroy_process_group takes {params}, not (group=None, ...)")


ASSUMPTIONS = (
    probes.Assumption("destroy-signature", "torch.distributed.destroy_process_group(group=None, ...)",
                      _check_signature),
)


def install() -> list[str]:
    if not probes.verify("teardown", ASSUMPTIONS, "A DDP's reducer is freed whenever Python frees it (the rare "
                         "GIL deadlock at exit of NOTE [Reducer outliving its process group] can return)"):
        return []
    _patch_destroy_process_group()
    REGISTRY.add_handle(_AtExit(pause_for_collective_workers))  # NOTE [A pause at exit]
    return list(TARGETS)
