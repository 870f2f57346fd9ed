"""What many test files share: the same case run with and without the library (``library``), the library's log
lines (``LibraryLog``, ``library_warnings``), and graph and marker helpers. Plain functions and context managers,
not fixtures: the rank functions that use them run in spawned processes (tests/harness.py), where fixtures do not.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest

import ddp_patches
from tests.harness import grad_fn_names

needs_deepspeed = pytest.mark.deepspeed  # skipped without deepspeed (tests/conftest.py), run last in CI


def library(patched: bool, **options) -> contextlib.AbstractContextManager:
    """``ddp_patches.patched(**options)`` when ``patched``, else a block that changes nothing: one case, written
    once, run with the library and without it (where torch raises or hangs)."""
    return ddp_patches.patched(**options) if patched else contextlib.nullcontext()


class LibraryLog(logging.Handler):
    """The ``ddp_patches`` logger's lines at ``level`` and above while entered: ``messages``, and ``records``
    (step, level name, message), ``step`` being what the test set it to when the line came (``lines(needle)``)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []
        self.records: list[tuple[int, str, str]] = []
        self.step = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.records.append((self.step, record.levelname, record.getMessage()))

    def __enter__(self) -> "LibraryLog":
        logger = logging.getLogger("ddp_patches")
        self._old_level = logger.level
        logger.addHandler(self)
        if self.level < logging.WARNING:  # INFO lines are filtered at the logger before any handler sees them
            logger.setLevel(self.level)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("ddp_patches")
        logger.removeHandler(self)
        logger.setLevel(self._old_level)

    def lines(self, needle: str) -> list[tuple[int, str, str]]:
        """The records whose message contains ``needle``."""
        return [r for r in self.records if needle in r[2]]


@contextlib.contextmanager
def library_warnings() -> Iterator[list[str]]:
    """The library's WARNING (and ERROR) messages logged inside the block; the list fills as they come."""
    with LibraryLog() as log:
        yield log.messages


def reentrant_nodes(t) -> int:
    """Reentrant checkpoints that stayed reentrant (CheckpointFunctionBackward nodes) in t's graph."""
    return grad_fn_names(t)["CheckpointFunctionBackward"]
