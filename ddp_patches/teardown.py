"""Mechanism 2c: a DDP's reducer and its process group are released when the group is destroyed, not at exit.

# NOTE [Reducer outliving its process group]
# transformers >= 5.18 ends a run with ``trainer.end()`` -> accelerate -> ``torch.distributed.destroy_process_group``
# while the DDP model is still alive (the Trainer, its accelerator and the model hold each other in reference
# cycles). destroy_process_group drops only the group registry's references: the reducer and the DDP module keep
# theirs, so ``~ProcessGroupGloo`` (which joins the group's worker threads) runs whenever the DDP is finally
# freed -- usually by the last garbage collection during interpreter shutdown, when a thread that needs the GIL
# can no longer get it. TRL's sft.py was seen blocked there (``~Reducer -> ~ProcessGroupGloo -> thread join``),
# with or without this library. The library builds the DDP, so it can order the teardown: just before the group
# is destroyed, every DDP built under apply() on that group drops its reducer, its logger and its reference to
# the group. The group's destructor then runs inside destroy_process_group, in a healthy interpreter, on every
# rank at the same point of the program. The DDP object stays usable for what needs no communication
# (state_dict(), evaluation of a model without buffers); a training forward on it raises a clear error.
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
    """Drop the references that keep the process group alive: the reducer, its logger, the group itself."""
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
                if _uses(ddp, group) and not isinstance(getattr(ddp, "reducer", None), ReleasedReducer):
                    release(ddp)
                    _live.discard(ddp)
                    logger.debug("ddp_patches: released a DDP reducer before destroy_process_group")
        return original(group, *args, **kwargs)

    return destroy_process_group


def _patch_destroy_process_group() -> None:
    REGISTRY.install(dist, "destroy_process_group", _patched_destroy_process_group)


def install() -> list[str]:
    _patch_destroy_process_group()
    return list(TARGETS)
