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
"""

from __future__ import annotations

import logging
import weakref

import torch.distributed as dist
from torch import nn

from ._registry import REGISTRY

logger = logging.getLogger("ddp_patches")

TARGETS = ("torch.distributed.destroy_process_group",)

_live: weakref.WeakSet = weakref.WeakSet()


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


def _uses(ddp: nn.Module, group) -> bool:
    if group is None:  # the default group: everything goes with it (destroy_process_group() destroys all)
        return True
    return getattr(ddp, "process_group", None) is group


def _patched_destroy_process_group(original):
    def destroy_process_group(group=None, *args, **kwargs):
        if dist.is_initialized():
            for ddp in list(_live):
                if _uses(ddp, group):
                    release(ddp)
                    _live.discard(ddp)  # released once: a later destroy_process_group() leaves it alone
                    logger.debug("ddp_patches: released a DDP reducer before destroy_process_group")
        return original(group, *args, **kwargs)

    return destroy_process_group


def _patch_destroy_process_group() -> None:
    REGISTRY.install(dist, "destroy_process_group", _patched_destroy_process_group)


def install() -> list[str]:
    _patch_destroy_process_group()
    return list(TARGETS)
