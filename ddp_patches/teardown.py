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
# usable for what needs no communication (state_dict(), evaluation of a model without buffers); a training
# forward raises a clear error.
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

import torch.distributed as dist
from torch import nn

from . import probes, versions
from ._registry import REGISTRY
from .distributed import world_is_distributed

logger = logging.getLogger("ddp_patches")

TARGETS = ("torch.distributed.destroy_process_group",)

_live: weakref.WeakSet = weakref.WeakSet()
_was_distributed: list[bool] = []  # set once a patched destroy_process_group saw world size > 1


class ReleasedReducer:
    """Stands in for ``DistributedDataParallel.reducer`` and ``.logger`` once their process group was destroyed."""

    def __getattr__(self, name: str):
        raise RuntimeError(
            "ddp_patches: this DistributedDataParallel's process group was destroyed "
            "(torch.distributed.destroy_process_group, e.g. by trainer.end()), and its reducer was released with "
            "it (NOTE [Reducer outliving its process group] in ddp_patches/teardown.py). Wrap the model in a new "
            "DistributedDataParallel after init_process_group to train again."
        )


def track(ddp: nn.Module) -> None:
    """Remember a DDP built under apply(), weakly."""
    _live.add(ddp)


def release(ddp: nn.Module) -> None:
    """Free the reducer while its group is referenced elsewhere, then drop the DDP's own group reference.

    The order is the fix: NOTE [Reducer outliving its process group].
    """
    ddp.reducer = ddp.logger = ReleasedReducer()
    ddp.process_group = None


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
