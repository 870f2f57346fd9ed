"""Bringing offloaded checkpoint inputs back for backward, in whatever order autograd unpacks them.

``offload.CheckpointInputOffloader.unpack`` hands every offloaded handle here. The restorer decides where the
device tensor comes from (still on the device, kept alive by someone else, already restored, prefetched, or a
copy in started now) and which inputs to start bringing back next. See NOTE [Any unpack order] below and NOTE
[Copies, streams and lifetimes] in ``offload.py``.

# NOTE [Any unpack order]
# torch documents the order in which saved tensors are unpacked as unspecified. The common order is the reverse
# of pack order (a sequential backward), and that is the only thing the prefetch *guesses*: after layer k's input
# is unpacked, the nearest earlier inputs that are not back yet are the ones asked for next. Nothing else depends
# on the guess:
#   * values: every unpack checks the version witness and serves the handle's own tensor, whichever path it
#     takes; a handle's restored tensor is kept on the handle (a second backward under ``retain_graph``, a shared
#     input) and dies with it, so nothing outlives autograd's own reference;
#   * memory: prefetched tensors that wait for their unpack are at most ``prefetch_depth``. A new guess beyond that
#     drops the oldest unused one that is no longer among the nearest (``PrefetchedInput`` makes the stream it
#     was allocated on wait for its copy, so the block is reused safely) and counts it in
#     ``stats.prefetch_dropped``; that input is copied again if it is asked for later. Without the bound a
#     random order (``autograd.grad`` of one layer at a time, a gradient penalty) piled up guesses, up to one
#     device copy per layer until the graph died;
#   * guesses come only from the first unpack of a layer's own input. The first unpack of an input shared by
#     several checkpoints (a mask packed once, deduplicated) happens at the last layer that uses it and says
#     nothing about which layer comes next: guessing from it prefetched the very first layer's input at the
#     start of backward. A second unpack of the same input (a second backward under ``retain_graph``) says
#     nothing new either: guessing from it replaced a good guess by a farther one.
# In forward order the guess never finds anything to fetch (every earlier input is back already): each unpack
# waits for its own copy, which is correct, only not overlapped.
"""

from __future__ import annotations

import collections
import weakref

import torch

from .offload_copier import PrefetchedInput
from .offload_policy import check_version


class Restorer:
    """Serves unpacked handles and keeps at most ``prefetch_depth`` guesses in flight (NOTE [Any unpack order]).

    ``copier`` is a callable returning the copier (the offloader creates it lazily); the handles are
    ``offload._Offloaded`` objects, read through their attributes only.
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
