"""Bringing offloaded checkpoint inputs back for backward, in whatever order autograd unpacks them.

``offloader.CheckpointInputOffloader.unpack`` hands every offloaded handle to a ``Restorer``, which decides where
the device tensor comes from (still on the device, kept alive by someone else, already restored, prefetched, or a
copy in started now) and which inputs to start bringing back next (NOTE [Any unpack order]).
"""

from __future__ import annotations

import collections
import weakref

import torch

from .copier import PrefetchedInput
from .policy import check_version


# NOTE [Any unpack order]
# Invariant: torch leaves the unpack order of saved tensors unspecified; values never depend on it, and the device
# memory held by prefetches is bounded in any order. The prefetch only *guesses* the common order, the reverse of
# pack order: after layer k's input, the nearest earlier inputs not back yet.
# Rule: every unpack checks the version witness and serves the handle's own tensor, whichever path it takes; a
# restored tensor is kept on the handle (a second backward under ``retain_graph``, a shared input) and dies with it.
# At most ``prefetch_depth`` prefetched tensors wait: a new guess beyond that drops the oldest unused one no longer
# among the nearest (its stream waits for its copy first; counted in ``stats.prefetch_dropped``). Guesses come only
# from the first unpack of a layer's own input: an input shared by several checkpoints is first unpacked at the
# last layer that uses it, and a second unpack of an input (``retain_graph``) says nothing new. In forward order
# nothing is prefetched: each unpack waits for its own copy, correct but not overlapped.
# Test: tests/test_offload_lifecycle.py::test_any_unpack_order_gives_exact_gradients_and_bounded_copies
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
class Restorer:
    """Serves unpacked handles and keeps at most ``prefetch_depth`` guesses in flight (NOTE [Any unpack order]).

    ``copier`` is a callable returning the copier (the offloader creates it lazily); the handles are
    ``handles._Offloaded`` objects, read through their attributes only.
    """

    def __init__(self, copier, prefetch_depth: int) -> None:
        self._copier = copier
        self.depth = prefetch_depth
        self._waiting: collections.deque = collections.deque()  # weakrefs of handles with an unused prefetch

    # -- one unpack -----------------------------------------------------------------------------------------
    def unpack(self, h, window) -> torch.Tensor:
        check_version(h.witness, h.version, h.shape, h.dtype)
        stats = window.stats
        if h.restored is not None:
            stats.restored_again += 1
            return h.restored  # a shared input or a second backward: no copy, no new guess
        tensor = self._on_device(h, stats)
        if tensor is None:
            tensor = h.restored = self._bring_back(h, stats)
        first, h.unpacked = not h.unpacked, True
        if first and not h.shared:  # only a first unpack of a layer's own input says where backward is
            self.prefetch_before(h.index, window)  # queued behind this layer's recompute and backward
        return tensor

    @staticmethod
    def _on_device(h, stats) -> torch.Tensor | None:
        """The tensor when it never left the device: still in the in-flight window, or released while
        something else kept its memory alive (no copy needed)."""
        if h.source is not None:
            if not h.counted_kept:
                h.counted_kept = True
                stats.kept_last += 1
            return h.source
        return h.origin()

    def _bring_back(self, h, stats) -> torch.Tensor:
        if h.prefetched is not None:
            pending, h.prefetched = h.prefetched, None
            stats.prefetched += 1
        else:
            pending = self.copy_in(h, stats)
            stats.waited += 1
        return pending.take()

    # -- copies in ------------------------------------------------------------------------------------------
    def copy_in(self, h, stats) -> PrefetchedInput:
        """Start the host-to-device copy of ``h`` into a fresh tensor with its strides."""
        out = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)
        stats.copies_in += 1
        copier = self._copier()
        return PrefetchedInput(out, copier.to_device(h.host, out), copier)

    def prefetch_before(self, index: int, window) -> None:
        """Have the ``depth`` nearest inputs packed before ``index`` that are not back yet on their way."""
        targets = [h for h in window.earlier(index) if h.offloaded and h.restored is None][:self.depth]
        for h in targets:
            if h.prefetched is None:
                h.prefetched = self.copy_in(h, window.stats)
                self._waiting.append(weakref.ref(h))
        self._bound(targets, window.stats)

    def _bound(self, targets: list, stats) -> None:
        """At most ``depth`` prefetched tensors wait for their unpack: drop the oldest guesses that are no longer
        among the nearest (``targets``) beyond that."""
        self._waiting = collections.deque(r for r in self._waiting if _still_waiting(r()))
        stale = [r for r in self._waiting if all(r() is not h for h in targets)]
        for ref in stale[:max(0, len(self._waiting) - self.depth)]:
            self._waiting.remove(ref)
            h = ref()
            if h is None:  # died since the filter above (a collection ran): its prefetch went with it
                continue
            h.prefetched = None  # PrefetchedInput.__del__: the stream waits for the copy before reuse
            stats.prefetch_dropped += 1

    def waiting(self) -> int:
        """Prefetched tensors not taken yet (at most ``depth``)."""
        return sum(_still_waiting(r()) for r in self._waiting)


def _still_waiting(h) -> bool:
    return h is not None and h.prefetched is not None
