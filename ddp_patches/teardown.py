"""Mechanism 2c: a DDP's reducer and its process group are released when the group is destroyed, not at exit.

# NOTE [Reducer outliving its process group]
# Seen here (TRL's sft.py, 2 gloo ranks, unpatched, py-spy): the main thread frees the Trainer's DDP, pybind11
# deallocates its ``Reducer`` with the GIL held (``dealloc_without_manipulating_gil``), ``~Reducer`` drops the last
# reference to the process group, and ``~ProcessGroupGloo`` joins the group's worker threads -- while one worker is
# still destroying its last finished ``AsyncAllgatherWork``, whose tensor decref needs the GIL. A deadlock, with
# or without this library (reported in one run of six; about one in eighteen here). torch guards the process group's own Python handle against
# exactly this (its holder releases the GIL before the destructor runs); the Reducer's holder does not. It
# happens whenever a DDP outlives ``destroy_process_group`` -- transformers >= 5.18 calls it from ``trainer.end()``
# while the Trainer still holds the DDP model.
#
# So the reducer must never hold the last reference to its group. Just before a group is destroyed, every DDP
# built under apply() on that group drops its reducer (and the logger that shares it) while the group registry
# and ``ddp.process_group`` still reference the group, then drops ``process_group``. ~Reducer then frees no
# group, and the group's own destructor runs afterwards through its GIL-releasing handle. The DDP object stays
# usable for everything that needs no communication: NOTE [A DDP after its group was destroyed].
#
# NOTE [A DDP after its group was destroyed]
# With its reducer gone a DDP must still do, as the plain module would, what needs no collective: state_dict(),
# evaluation with or without grad mode, the input gradient of an output (saliency maps, adversarial evaluation),
# local accumulation under no_sync(). Only a real collective may fail, and then clearly. What DDP asks of its
# reducer and logger (torch 2.13 _pre_forward / _post_forward), and what the stand-in, ReleasedReducer, answers:
#   * grad mode on and require_backward_grad_sync: logger.set_runtime_stats_and_log() and
#     reducer.prepare_for_forward(): bookkeeping, nothing to do.
#   * grad mode on: reducer._rebuild_buckets(), a broadcast of bucket indices once, at the first forward after
#     the first backward. No reducer, no buckets: False ("not rebuilt"), and no collective.
#   * after the module, grad mode on and require_backward_grad_sync: reducer.prepare_for_backward(outputs), which
#     arms the reducer's autograd hooks (expect_autograd_hooks_); the stand-in arms its refusal (below).
#   * logger.set_error_and_log(message), which DDP's _log_and_throw calls before raising: nothing, so DDP's own
#     error is the one raised.
#   Anything else (join, comm hooks, _set_static_graph, the static graph's first delayed all-reduce in _DDPSink)
#   configures or runs communication, and raises the stand-in's error naming it.
# A backward: the reducer hooked each trainable parameter's AccumulateGrad node and, once armed, all-reduces what
# they accumulate. ~Reducer removed those hooks, so a backward would now write local, unaveraged gradients without
# a word. So the stand-in mirrors the reducer's flag: armed by prepare_for_backward, a pre-hook on each of those
# nodes -- held by the stand-in, as the reducer held them -- raises in the first backward that reaches them, before
# anything is accumulated, and disarms, as that backward's finished reduction would have cleared the reducer's
# flag (the rest of that graph task is refused too). So after the error, the advice in it works: a backward of a
# forward through ``ddp.module`` or under no_sync() accumulates locally. A node pre-hook runs only when the node
# runs: ``torch.autograd.grad`` of an output w.r.t. the input (or the parameters) runs no AccumulateGrad node,
# so no DDP hook either (NOTE [Only a backward that accumulates] in ddp_patches/reach.py), and works as without
# the library; so does a backward under no_sync() or through ``ddp.module`` while no synced forward is pending.
# Measured unpatched (torch 2.13, gloo, 2 ranks in lockstep): after destroy_process_group the old reducer still
# all-reduces over the shut-down group; that cannot outlive freeing the group (the note above), so here it is an
# error that says what to do. A new DDP on the same module shares these nodes: its construction under apply() retires the
# released stand-ins' hooks (track()), so the refusal does not follow the module.
# Buffers: before a forward that follows a training forward, a DDP with buffers and broadcast_buffers=True
# broadcasts them from rank 0 through ``_distributed_broadcast_coalesced`` (DDP's only caller of
# dist._broadcast_coalesced). With ``process_group`` None that binding gets a null group and segfaults (measured:
# an eval forward of a BatchNorm model under no_grad killed both ranks). Skipping it would leave each rank its own
# buffers where DDP gives rank 0's, so on a released DDP that method is replaced, on the instance, by a clear
# error.
#
# NOTE [Groups held by default arguments]
# Releasing the reducer is not enough for the group to go: some torch modules write ``group=group.WORLD`` in a
# signature (torch.distributed.nn.functional, which DDP's constructor imports lazily; ZeroRedundancyOptimizer's
# _broadcast_object; ShardedGradScaler), and imported while a default group exists, each such default holds that
# group object for the life of the process (ten references after the first DDP; measured here with
# sys.getrefcount). destroy_process_group then frees nothing: ~ProcessGroupGloo never runs and its worker threads
# live until interpreter exit. A worker that is still destroying its last finished allgather when the interpreter
# finalizes asks for the GIL, is told to exit, and the forced unwind through a noexcept destructor aborts the
# process after a completed run: "terminate called without an active exception", exit code -6 (seen here in 1 of
# 40 runs of TRL's sft.py, patched and unpatched alike; the core shows the worker in ~AsyncAllgatherWork ->
# THPVariable_clear -> take_gil -> PyThread_exit_thread). So after the group is destroyed, every default argument
# of those modules' functions that still holds a group no longer registered is set to None, which they pass on to
# torch.distributed, where None means the default group at call time. The group is then freed inside
# destroy_process_group, through its own GIL-releasing handle. This is one-way (revert() puts no dead group back):
# a dead group in a default argument fails a later call or, worse, runs it on the destroyed group (measured:
# torch.distributed.nn.functional.all_reduce after a re-init), whereas None finds the newly created group.
# Not covered: an instance that holds the group itself (a ZeroRedundancyOptimizer or ShardedGradScaler alive at
# destroy keeps ``self.process_group``), as without the library; NOTE [A pause at exit] covers what is left.
#
# NOTE [A pause at exit]
# The abort needs no leftover group: a collective's work holds its tensors, and when Python has already dropped
# them (``dist.all_gather([torch.zeros(n), ...], torch.ones(n))``, temporaries, as accelerate's gather and TRL's
# metrics do) the worker thread frees them after the caller's wait() returned, and must take the GIL to do it.
# The main thread holds the GIL; if it reaches interpreter finalization within the few milliseconds before it
# hands the GIL over, the worker is told to exit and the process aborts. Measured with a 3-line script (three
# such all_gathers on 2 gloo ranks, then exit, group never destroyed): 15 of 20 runs abort; with a 50 ms sleep
# registered with atexit (atexit callbacks run before finalization, and a sleep releases the GIL), 0 of 20. It
# is also what remained of the abort in TRL's sft.py after the fix above (1 of 10 patched runs on CI's 2 cores).
# So the teardown patch registers such a pause, which runs in a process that was distributed (world size > 1)
# and costs it EXIT_PAUSE_S at exit (0.1 s, twice the measured 50 ms, for headroom on a loaded machine); revert()
# unregisters it. Both it and the patched destroy_process_group ask world_is_distributed(), never is_distributed():
# the latter's first call runs the on-first callbacks (an import of torch._dynamo, ~1.5 s), a cost a script that
# only ran collectives must not pay while it shuts down. It cannot help a collective still running at exit
# (async_op=True left unwaited): that work frees its tensors after finalization began, with or without us.
#
# NOTE [Freeing a group needs a GIL-free destructor]
# Both notes above end with the group freed inside destroy_process_group, "through its own GIL-releasing handle".
# That handle came with torch 2.8 (pytorch#154976). Before it, the last decref of a ProcessGroup runs
# ~ProcessGroupGloo with the GIL held, and that joins the worker threads -- one of which may still be destroying a
# finished allgather of temporaries and waiting for the GIL: the deadlock of the first note, inside
# destroy_process_group. torch 2.4 and 2.7 have it without the library: init, three all_gathers of temporaries,
# destroy_process_group, on 2 gloo ranks, hangs in 9 of 20 runs on torch 2.4.0 and 6 of 20 on 2.7.1 (py-spy:
# MainThread in ~ProcessGroupGloo -> thread::join, the worker in ~AsyncAllgatherWork -> gil_scoped_acquire), 0 of
# 20 on 2.8.0 and 0 of 25 on 2.13. With a DDP alive it did not happen there unpatched, because the DDP kept the
# group to exit; releasing the reducer first moved the last decref into destroy_process_group and so into the
# deadlock (the oldest lane's CI run; 2 of 16 patched runs of that test's script here). The deadlock needs a
# worker that has not yet freed a finished collective, so on torch < 2.8 the patched destroy_process_group first
# sleeps EXIT_PAUSE_S, which releases the GIL, as the pause at exit does: the same 2.4 script with a 0.1 s sleep
# before destroy_process_group hangs in 0 of 20 runs. It is a pause, not a proof: a worker descheduled for longer
# can still deadlock, as it can without the library. apply()'s report names the pause on such a torch.
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

from . import probes, versions
from ._registry import REGISTRY
from .distributed import world_is_distributed

logger = logging.getLogger("ddp_patches")

TARGETS = ("torch.distributed.destroy_process_group",)

_live: weakref.WeakSet = weakref.WeakSet()
_was_distributed: list[bool] = []  # set once a patched destroy_process_group saw world size > 1


def _destroyed(what: str) -> str:
    return (f"ddp_patches: {what}, but this DistributedDataParallel's process group was destroyed "
            "(torch.distributed.destroy_process_group, e.g. by trainer.end()), and its reducer was released with it "
            "(NOTE [Reducer outliving its process group] in ddp_patches/teardown.py). To train again, call "
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


class ReleasedReducer:
    """Stands in for ``DistributedDataParallel.reducer`` and ``.logger`` once their process group was destroyed:
    answers what a forward asks without a collective, and refuses a backward DDP would all-reduce (NOTE [A DDP
    after its group was destroyed])."""

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


def release(ddp: nn.Module) -> None:
    """Free the reducer while its group is referenced elsewhere, then drop the DDP's own group reference.

    The order is the fix: NOTE [Reducer outliving its process group]. What the DDP can still do: NOTE [A DDP after
    its group was destroyed].
    """
    stand_in = ReleasedReducer(_trainable(ddp))
    ddp.reducer = ddp.logger = stand_in
    ddp.process_group = None
    ddp._distributed_broadcast_coalesced = _refuse_buffer_broadcast  # never hand None to the C++ broadcast
    _released.add(stand_in)


# Modules that bind ``group.WORLD`` in signatures at import (NOTE [Groups held by default arguments]); only those
# already imported are looked at.
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
