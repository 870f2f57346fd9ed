"""Host buffers for offloaded activations: reused across steps, capped per rank.

# NOTE [Why a pool, and why a cap]
# Every layer input of a step has the same byte size, and every step repeats the same sizes, so a free list
# keyed by exact size turns "allocate N pinned buffers per step" into "allocate N once". torch's own caching
# host allocator would also reuse pinned blocks, but it rounds each request up to a power of two (up to 2x the
# pinned memory), never gives memory back to the OS and has no limit. Pinned memory is page-locked: 8 ranks on
# one node each pinning "whatever they need" can starve the host. So the pool owns at most ``cap_bytes`` (per
# rank; the default divides a share of physical RAM by LOCAL_WORLD_SIZE) and says no beyond it: the caller then
# leaves that tensor on the device, which costs nothing compared with not offloading at all.
#
# Reuse is safe without events because every copy into or out of a pool buffer is issued on one copy stream,
# so a device-to-host copy into a buffer is ordered after the host-to-device copy that last read it.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

_DEFAULT_HOST_SHARE = 0.25  # of physical RAM, split between the ranks of a node


def default_cap_bytes() -> int:
    """A quarter of physical RAM divided by the ranks on this node (LOCAL_WORLD_SIZE, as set by torchrun)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: be conservative
        physical = 16 << 30
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(physical * _DEFAULT_HOST_SHARE) // local_ranks


class PinnedBufferPool:
    """Byte buffers (uint8, 1-D) handed out by exact size and taken back for the next step.

    ``pin=False`` gives ordinary host memory; CPU-only tests use it to run the same bookkeeping.
    """

    def __init__(self, cap_bytes: int, *, pin: bool = True) -> None:
        if cap_bytes < 0:
            raise ValueError(f"PinnedBufferPool: cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.owned_bytes = 0  # allocated by the pool, in use or free
        self.in_use_bytes = 0
        self.peak_owned_bytes = 0
        self.peak_in_use_bytes = 0
        self.refused = 0

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of exactly ``nbytes``, or None when that would take the pool over its cap."""
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
        else:
            if self.owned_bytes + nbytes > self.cap_bytes:
                self._drop_free_buffers()  # sizes that are no longer asked for make room first
            if self.owned_bytes + nbytes > self.cap_bytes:
                self.refused += 1
                return None
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.owned_bytes += nbytes
            self.peak_owned_bytes = max(self.peak_owned_bytes, self.owned_bytes)
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        self._free[buf.numel()].append(buf)

    def free_bytes(self) -> int:
        return self.owned_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Give every free buffer back (buffers still in use stay with their holders)."""
        self._drop_free_buffers()

    def _drop_free_buffers(self) -> None:
        for size, bufs in self._free.items():
            self.owned_bytes -= size * len(bufs)
        self._free.clear()
