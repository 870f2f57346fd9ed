"""Host buffers for offloaded activations: size classes reused across steps, a real bound, one free list per device.

``PinnedBufferPool`` (NOTE [Why a pool, and why a cap]) pins ahead of the forward on a background thread
(NOTE [Pinning ahead]); ``default_cap_bytes()`` is its per-rank default cap.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import torch

DEFAULT_PREPIN_AHEAD = 2  # free buffers of a growing class kept pinned ahead (NOTE [Pinning ahead])
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


# NOTE [Why a pool, and why a cap]
# Invariant: pinned (page-locked) host memory stays under a per-rank cap, counted as the real footprint: 8 ranks
# each pinning "whatever they need" can starve the host, and torch's caching host allocator rounds every request up
# to a power of two and never gives freed blocks back to the OS.
# Rule: hand out buffers in power-of-two size classes (what the allocator reserves, so ``owned_bytes`` is the real
# footprint), reusing a free buffer of the class or else of the smallest larger one (a new padded length every step
# reuses instead of pinning); never drop a buffer to "make room"; refuse a request beyond the cap, and a failed
# pinned allocation, the same way (the caller keeps that tensor on the device; never an exception inside forward).
# The default cap is a share of the memory this process may use (cgroup limit, else RAM) split between the node's
# ranks. Reuse needs no events: every copy into or out of a buffer is issued on its device's one copy stream, so
# free lists are per device (NOTE [Several devices]).
# Tests: tests/test_pinned_pool.py::test_refuses_beyond_the_cap_and_never_exceeds_it and
# tests/test_pinned_pool.py::test_varying_lengths_reuse_instead_of_allocating
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
class PinnedBufferPool:
    """Byte buffers (uint8, 1-D, a power of two long) per device, reused across steps, under a hard cap.

    ``pin=False`` gives ordinary host memory; CPU-only tests use it to run the same bookkeeping. ``allocate``
    can be injected (tests: an allocation that fails, or one that records where it ran). ``prepin_ahead``: free
    buffers of a growing class to pin on a background thread (NOTE [Pinning ahead]); 0: lazily only.
    """

    def __init__(self, cap_bytes: int, *, pin: bool = True, allocate=None, prepin_ahead: int = 0) -> None:
        if cap_bytes < 0:
            raise ValueError(f"PinnedBufferPool: cap_bytes must be >= 0, got {cap_bytes}")
        if prepin_ahead < 0:
            raise ValueError(f"PinnedBufferPool: prepin_ahead must be >= 0, got {prepin_ahead}")
        self.cap_bytes = cap_bytes
        self.pin = pin
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=self.pin))
        self._free: dict[tuple, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.owned_bytes = 0  # allocated by the pool, in use or free (class sizes: the real footprint)
        self.in_use_bytes = 0
        self.peak_owned_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0  # inside acquire(): on the forward's path
        self.allocate_seconds = 0.0  # spent pinning new buffers inside acquire() (reported per step)
        self.prepin_ahead = prepin_ahead
        self.allocated_ahead = 0  # pinned off the forward's path: reserve() and the pinning-ahead thread
        self.prepin_failed = 0
        self._unused: set[int] = set()  # ids of buffers pinned ahead and not handed out yet
        self._wanted: dict[tuple, int] = {}  # (device key, class) -> free buffers the thread should keep
        self._thread: threading.Thread | None = None
        self.reused = 0
        self.refused = 0
        self.failed = 0
        self.last_error: str | None = None
        # release() also runs from autograd's device threads (a handle freed in backward), one per GPU, and from a
        # garbage collection inside the pool's own bookkeeping: NOTE [Releases from a garbage collection]
        self._lock = threading.RLock()
        self._depth = 0  # how deep the thread holding the lock is inside the pool's bookkeeping
        self._returned: list[tuple[torch.Tensor, object]] = []  # releases deferred to the end of that bookkeeping

    def acquire(self, nbytes: int, device: object = None) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` for ``device``'s copy stream, or None (cap reached, allocation failed)."""
        with self._guard():
            buf, grew = self._acquire(nbytes, device)
            if grew and self.prepin_ahead:
                self._pin_ahead(size_class(nbytes), device)
            return buf

    def _acquire(self, nbytes: int, device: object) -> tuple[torch.Tensor | None, bool]:
        """The buffer, and whether it is a new one (pinned now, or ahead and never used): the forward grows."""
        wanted = size_class(nbytes)
        buf = self._take_free(self._free[_key(device)], wanted)
        grew = buf is not None and id(buf) in self._unused
        if buf is not None:
            self.reused += 1
            self._unused.discard(id(buf))
        else:
            if self.owned_bytes + wanted > self.cap_bytes:
                self.refused += 1
                return None, False
            start = time.perf_counter()
            try:
                buf = self._allocate(wanted)
            except RuntimeError as e:  # cudaHostAlloc refused: keep the tensor on the device instead
                self.failed += 1
                self.last_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                return None, False
            finally:
                self.allocate_seconds += time.perf_counter() - start
            self.allocations += 1
            self.owned_bytes += wanted
            self.peak_owned_bytes = max(self.peak_owned_bytes, self.owned_bytes)
            grew = True
        self.in_use_bytes += buf.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf, grew

    def release(self, buf: torch.Tensor, device: object = None) -> None:
        with self._guard():
            if self._depth > 1:  # re-entered by a finalizer mid-bookkeeping: applied when that bookkeeping ends
                self._returned.append((buf, device))
                return
            self._give_back(buf, device)

    def _give_back(self, buf: torch.Tensor, device: object) -> None:
        self.in_use_bytes -= buf.numel()
        self._free[_key(device)][buf.numel()].append(buf)

    # NOTE [Releases from a garbage collection]
    # release() is a handle's finalizer (weakref.finalize in offloader.py). A handle whose graph died in a reference
    # cycle (a forward thrown away while an exception's traceback, or any object in a cycle, held its output) is
    # freed by the cyclic garbage collector, and a collection can start at any allocation of a Python object: also
    # inside the pool's own bookkeeping, on the thread that holds the lock (a new tensor in ``_allocate``, a list in
    # ``_take_free`` or in the pinning-ahead thread's ``_next_job``). With a plain lock, that release waited for the
    # lock its own thread held: the rank hung in the forward (or the pinning-ahead thread did, and every later pack
    # with it). The lock is therefore reentrant, and a release that finds its own thread already inside the
    # bookkeeping (``_depth`` > 1) is deferred: applied when the outermost section ends, so no free list changes
    # under an iteration and no count is read half-updated. Other threads still wait for the lock.
    # Test: tests/test_offload_lifecycle.py::test_graph_freed_by_a_gc_inside_the_pools_bookkeeping_does_not_hang
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
    def _guard(self) -> "_Guard":
        return _Guard(self)

    # -- pinning ahead ------------------------------------------------------------------------------------------
    # NOTE [Pinning ahead]
    # Invariant: the forward does not pay for pinning (cudaHostAlloc) where the pool can pin off its path, and
    # pinning ahead neither breaks the cap nor makes a pack wait.
    # Rule: a pack that had to take a *new* buffer (pinned inside it, or pinned ahead and never used) asks a daemon
    # thread to keep ``prepin_ahead`` free buffers of that class and device, pinned while the layer computes. Only
    # growth asks; when the forward stops growing, at most ``prepin_ahead`` buffers per class stay unused. A buffer
    # pinned ahead counts in ``owned_bytes`` under the lock before it is allocated; the thread holds the lock for
    # bookkeeping only, never across an allocation, and a pack that finds no free buffer pins its own. A failure in
    # the thread stops pinning ahead (``prepin_failed``), never the pack. CUDA hosts only (the offloader's default
    # pool); the thread ends when nothing is left to pin. ``reserve(nbytes, count)`` pins synchronously.
    # Tests: tests/test_pinned_pool.py::test_pinning_ahead_respects_the_cap_and_stops_on_a_failure and
    # tests/test_offload_lifecycle.py::test_step_one_packs_find_buffers_pinned_ahead_and_the_cap_holds
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §11
    def reserve(self, nbytes: int, count: int, device: object = None) -> int:
        """Pin up to ``count`` free buffers for requests of ``nbytes`` now, within the cap; returns how many."""
        done = 0
        while done < count and self._pin_one(size_class(nbytes), device):
            done += 1
        return done

    def _pin_ahead(self, wanted: int, device: object) -> None:
        """(Lock held.) Ask the thread to keep ``prepin_ahead`` free buffers of this class; start it if idle."""
        self._wanted[(_key(device), wanted)] = self.prepin_ahead
        if self._thread is None:
            self._thread = threading.Thread(target=self._pin_wanted, name="ddp_patches-prepin", daemon=True)
            self._thread.start()

    def _pin_wanted(self) -> None:
        while True:
            with self._guard():
                job = self._next_job()
                if job is None:
                    self._thread = None  # under the lock: the next request starts a new thread
                    return
            if not self._pin_one(*job):
                with self._guard():
                    self._wanted.clear()  # cap reached, or the host refused: stop until a pack grows again

    def _next_job(self) -> tuple[int, object] | None:
        """(Lock held.) A class with fewer free buffers than wanted, or None."""
        for (key, wanted), keep in list(self._wanted.items()):
            if len(self._free[key][wanted]) < keep:
                return wanted, _device_of(key)
            del self._wanted[(key, wanted)]
        return None

    def _pin_one(self, wanted: int, device: object) -> bool:
        """Allocate one free buffer of class ``wanted`` off the forward's path. The bytes count against the cap
        before the allocation starts; the lock is not held while it runs."""
        with self._guard():
            if self.owned_bytes + wanted > self.cap_bytes:
                return False
            self.owned_bytes += wanted
            self.peak_owned_bytes = max(self.peak_owned_bytes, self.owned_bytes)
        try:
            buf = self._allocate(wanted)
        except RuntimeError:
            with self._guard():
                self.owned_bytes -= wanted
                self.prepin_failed += 1
            return False
        with self._guard():
            self.allocated_ahead += 1
            self._unused.add(id(buf))
            self._free[_key(device)][wanted].append(buf)
        return True

    def join_prepin(self, timeout: float | None = None) -> None:
        """Wait until the pinning-ahead thread is idle (tests, benchmarks: a layer's compute outlasting it)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def free_bytes(self) -> int:
        return self.owned_bytes - self.in_use_bytes

    @staticmethod
    def _take_free(by_class: dict[int, list[torch.Tensor]], wanted: int) -> torch.Tensor | None:
        if by_class.get(wanted):
            return by_class[wanted].pop()
        larger = sorted(size for size, bufs in by_class.items() if size > wanted and bufs)
        return by_class[larger[0]].pop() if larger else None


class _Guard:
    """The pool's lock, counting how deep its holder is inside the bookkeeping; the outermost section applies the
    releases deferred inside it (NOTE [Releases from a garbage collection])."""

    __slots__ = ("pool",)

    def __init__(self, pool: PinnedBufferPool) -> None:
        self.pool = pool

    def __enter__(self) -> None:
        self.pool._lock.acquire()
        self.pool._depth += 1

    def __exit__(self, *exc) -> None:
        pool = self.pool
        try:
            while pool._depth == 1 and pool._returned:  # a release deferred now is still applied by this loop
                pool._give_back(*pool._returned.pop())
        finally:
            pool._depth -= 1
            pool._lock.release()


def _device_of(key: tuple):
    return None if key == (None, None) else torch.device(key[0], key[1])


def _key(device: object) -> tuple:
    if device is None:
        return (None, None)
    device = torch.device(device)
    return (device.type, device.index)
