"""Step windows and per-step accounting for offload: ``StepWindow``, ``OffloadStats`` (NOTE [Step windows]).

A window is one micro-step's packed checkpoint inputs, held through weak references only, so it never keeps a
saved input alive and stays bounded whatever the user does.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections import Counter


@dataclasses.dataclass
class OffloadStats:
    """What one micro-step did. Bytes "offloaded" are device bytes given back (the tensor's last holder dropped);
    a copy that would free nothing is counted under ``kept``."""

    step: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated: int = 0
    kept_last: int = 0  # still on the device when backward first asked for it (no copy in needed)
    kept: dict = dataclasses.field(default_factory=Counter)
    prefetched: int = 0  # unpacks served by a copy in started ahead of them
    prefetch_dropped: int = 0  # prefetches dropped unused (NOTE [Any unpack order] in restore.py)
    waited: int = 0  # unpacks that had to start their own host-to-device copy
    restored_again: int = 0  # unpacks served by a tensor already brought back (shared inputs)
    copies_in: int = 0  # host-to-device copies issued
    peak_pinned_bytes: int = 0
    pinned_allocations: int = 0  # new pinned buffers allocated inside a pack (their cost is paid in the forward)
    pin_ms: float = 0.0
    prepinned: int = 0  # buffers pinned ahead, off the forward's path (NOTE [Pinning ahead] in pinned_pool.py)
    stall_ms: float = 0.0  # GPU time the compute stream waited for copies in (only when the copier measures it)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kept"] = dict(self.kept)
        return d


# NOTE [Step windows]
# Invariant: the offload bookkeeping never depends on knowing when backward begins, and stays bounded whatever the
# user does. Nothing marks "backward has begun" reliably: an unpack can happen inside a forward
# (``torch.autograd.grad`` for a gradient penalty), two forwards can precede one backward, a backward can raise
# midway, a forward can be thrown away.
# Rule: no backward flag. A handle lives exactly as long as autograd keeps the saved input; an input still in the
# in-flight window is released when the next region begins, if it is still alive; a new accounting window (one
# micro-step in ``stats``) starts at the first pack after a backward has reached the window's inputs and every one
# of its handles has been freed (a checkpoint output dropped inside a forward frees handles too early to mark a
# step). The bookkeeping holds weak references only and is pruned at each pack.
# Tests: tests/test_offload_lifecycle.py::test_gradient_penalty_inside_forward_does_not_split_the_step and
# tests/test_offload_lifecycle.py::test_forwards_never_followed_by_a_backward_keep_bookkeeping_bounded
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
class StepWindow:
    """The handles of one micro-step, in pack order, plus the device-to-host copies still in flight."""

    def __init__(self, step: int = 1) -> None:
        self.stats = OffloadStats(step=step)
        self.order: list[weakref.ref] = []  # pruned of dead handles now and then; handle.index is its position
        self.by_key: dict[tuple, weakref.ref] = {}
        # one list per recent checkpoint region: weakrefs of its handles whose device tensor is still held
        self.in_flight: collections.deque = collections.deque()
        self.unpacked = False  # a backward reached this window's inputs
        self.region = 0  # checkpoint regions begun in this window (a handle records the one it was packed in)

    def add(self, handle, key: tuple) -> None:
        handle.index = len(self.order)
        self.by_key[key] = weakref.ref(handle)
        self.order.append(weakref.ref(handle))

    def find(self, key: tuple):
        ref = self.by_key.get(key)
        return ref() if ref is not None else None

    def live(self) -> list:
        return [h for h in (ref() for ref in self.order) if h is not None]

    def finished(self) -> bool:
        """A backward reached the inputs and autograd freed every one of them."""
        return self.unpacked and all(ref() is None for ref in self.order)

    def compact(self) -> None:
        """Drop dead references once they are the majority, renumbering the live handles."""
        live = [ref for ref in self.order if ref() is not None]
        if len(live) >= len(self.order) // 2:
            return
        self.order = live
        for i, ref in enumerate(live):
            h = ref()
            if h is not None:
                h.index = i
        self.by_key = {k: r for k, r in self.by_key.items() if r() is not None}

    def earlier(self, index: int) -> list:
        """Live handles packed before ``index``, nearest first."""
        return [h for h in (ref() for ref in reversed(self.order[:index])) if h is not None]


class ResourceMeter:
    """Charges a window with what the pool and the copier did while it was open: they count over the process's
    life, a window reports its own share."""

    def __init__(self) -> None:
        self._start = (0, 0.0, 0, 0.0)  # pool allocations, pool seconds, buffers pinned ahead, copier stall ms

    def charge(self, stats: OffloadStats, pool, copier) -> None:
        allocations, seconds, ahead, stalled = self._start
        now = (pool.allocations, pool.allocate_seconds, pool.allocated_ahead, copier.stall_ms())
        stats.pinned_allocations = now[0] - allocations
        stats.pin_ms = (now[1] - seconds) * 1e3
        stats.prepinned = now[2] - ahead
        stats.stall_ms = now[3] - stalled
        self._start = now
