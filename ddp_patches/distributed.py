"""The call-time gate: is this process one of several in a process group?

The process group is usually created after apply() (accelerate's PartialState, inside TrainingArguments or
SFTConfig), so every patch asks here when it runs, never when it is installed.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from ._registry import REGISTRY

logger = logging.getLogger("ddp_patches")

_logged_once: set[str] = set()


_on_first: list = []  # called once, the first time is_distributed() is True (NOTE [Compile notice armed lazily])


def world_is_distributed() -> bool:
    """True only when a default process group is initialized with world size > 1; nothing else happens.

    For code that runs at teardown and exit (ddp_patches/rescue/teardown.py): a collective-only script must not pay for
    what is_distributed() runs the first time (an import of torch._dynamo, about 1.5 s) while it shuts down.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_distributed() -> bool:
    """True only when a default process group is initialized with world size > 1.

    The first time it is, the callbacks of on_first_distributed() run (once).
    """
    result = world_is_distributed()
    if result and _on_first and not torch.compiler.is_compiling():  # never while dynamo traces
        waiting = list(_on_first)
        _on_first.clear()
        for callback in waiting:
            callback()
    return result


def on_first_distributed(callback) -> None:
    _on_first.append(callback)


def forget_pending() -> None:
    """Drop what waits for the first distributed call (at every revert: NOTE [Each module forgets its own state])."""
    _on_first.clear()


REGISTRY.on_reset(forget_pending)


def rank() -> int:
    """This process's rank; before the process group exists (apply() time), the launcher's RANK variable."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_int("RANK", 0)


def env_int(name: str, default: int, minimum: int | None = None, environ=None) -> int:
    """A launcher's integer variable (RANK, WORLD_SIZE, ...): ``default`` when unset or empty; a ValueError naming
    the variable when it is not a whole number, or is below ``minimum``."""
    text = (os.environ if environ is None else environ).get(name, "")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"expected {name} to be a whole number{bound}, as torchrun sets it; found {name}={text!r}: "
                         "unset it or correct it")
    return value


def log_rank0_once(key: str, level: int, msg: str, *args: object) -> None:
    """Log once per process (keyed), and only on rank 0, so an 8-rank job prints one line, not eight."""
    if key in _logged_once:
        return
    _logged_once.add(key)
    if rank() == 0:
        logger.log(level, msg, *args)


def reset_log_once() -> None:
    """Forget what was logged, so a later apply() reports again (NOTE [Each module forgets its own state])."""
    _logged_once.clear()


REGISTRY.on_reset(reset_log_once)
