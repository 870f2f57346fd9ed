"""Host buffers for offloaded activations: size classes reused across steps, a real bound, one free list per device.

# NOTE [Why a pool, and why a cap]
# Pinned memory is page-locked: 8 ranks on one node each pinning "whatever they need" can starve the host. torch's
# caching host allocator rounds every request up to a power of two, keeps freed blocks for itself and never gives
# them back to the OS. So a buffer handed back to torch is not memory given back, and a request of n bytes costs
# next_power_of_two(n). The pool therefore:
#   * hands out buffers in power-of-two size classes -- exactly what the allocator reserves, so ``owned_bytes`` is
#     the real pinned footprint -- and reuses any free buffer of the class asked for or, failing that, of the
#     smallest larger class, so per-batch padding (a new length every step) reuses buffers instead of pinning new
#     ones;
#   * never drops a buffer to "make room" (torch would keep it anyway) and refuses a request once the cap is
#     reached: the caller then leaves that tensor on the device, which costs nothing compared with not
#     offloading at all;
#   * catches a failed pinned allocation (the OS or driver said no) the same way: refused, never an exception
#     inside forward;
#   * derives its default cap from the memory this process may really use (the container's cgroup limit when
#     there is one, else physical RAM), split between the ranks of the node.
#
# Reuse is safe without events because every copy into or out of a buffer is issued on its device's one copy
# stream: a device-to-host copy into a buffer is ordered after the host-to-device copy that last read it. Buffers
# are therefore kept per device (NOTE [Several devices] in offload.py): a buffer last read by device 0's stream is
# never handed to device 1's.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import torch

_DEFAULT_HOST_SHARE = 0.25  # of the memory this process may use, split between the ranks of a node
_MIN_CLASS = 1 << 12
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def size_class(nbytes: int) -> int:
    """The power of two a request is served from (what torch's caching host allocator reserves for it)."""
    return max(_MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: be conservative
        return 16 << 30


def cgroup_limit_bytes(files: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max`` or v1), None when unlimited or unknown."""
    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # v1 reports "no limit" as a huge number, v2 as "max"
            return int(text)
    return None


def default_cap_bytes(cgroup_files: tuple[str, ...] = _CGROUP_FILES) -> int:
    """A quarter of the usable memory (the smaller of RAM and the cgroup limit) over LOCAL_WORLD_SIZE ranks."""
    usable = physical_memory_bytes()
    limit = cgroup_limit_bytes(cgroup_files)
    if limit is not None:
        usable = min(usable, limit)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(usable * _DEFAULT_HOST_SHARE) // local_ranks


class PinnedBufferPool:
    """Byte buffers (uint8, 1-D, a power of two long) per device, reused across steps, under a hard cap.

    ``pin=False`` gives ordinary host memory; CPU-only tests use it to run the same bookkeeping. ``allocate``
    can be injected (tests: an allocation that fails).
    """

    def __init__(self, cap_bytes: int, *, pin: bool = True, allocate=None) -> None:
        if cap_bytes < 0:
            raise ValueError(f"PinnedBufferPool: cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self.pin = pin
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=self.pin))
        self._free: dict[tuple, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.owned_bytes = 0  # allocated by the pool, in use or free (class sizes: the real footprint)
        self.in_use_bytes = 0
        self.peak_owned_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self.allocate_seconds = 0.0  # spent pinning new buffers (inside a forward: reported per step)
        self.reused = 0
        self.refused = 0
        self.failed = 0
        self.last_error: str | None = None
        # release() also runs from autograd's device threads (a handle freed in backward), one per GPU
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, device: object = None) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` for ``device``'s copy stream, or None (cap reached, allocation failed)."""
        with self._lock:
            return self._acquire(nbytes, device)

    def _acquire(self, nbytes: int, device: object) -> torch.Tensor | None:
        wanted = size_class(nbytes)
        buf = self._take_free(self._free[_key(device)], wanted)
        if buf is not None:
            self.reused += 1
        else:
            if self.owned_bytes + wanted > self.cap_bytes:
                self.refused += 1
                return None
            start = time.perf_counter()
            try:
                buf = self._allocate(wanted)
            except RuntimeError as e:  # cudaHostAlloc refused: keep the tensor on the device instead
                self.failed += 1
                self.last_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                return None
            finally:
                self.allocate_seconds += time.perf_counter() - start
            self.allocations += 1
            self.owned_bytes += wanted
            self.peak_owned_bytes = max(self.peak_owned_bytes, self.owned_bytes)
        self.in_use_bytes += buf.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor, device: object = None) -> None:
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._free[_key(device)][buf.numel()].append(buf)

    def free_bytes(self) -> int:
        return self.owned_bytes - self.in_use_bytes

    @staticmethod
    def _take_free(by_class: dict[int, list[torch.Tensor]], wanted: int) -> torch.Tensor | None:
        if by_class.get(wanted):
            return by_class[wanted].pop()
        larger = sorted(size for size, bufs in by_class.items() if size > wanted and bufs)
        return by_class[larger[0]].pop() if larger else None


def _key(device: object) -> tuple:
    if device is None:
        return (None, None)
    device = torch.device(device)
    return (device.type, device.index)
