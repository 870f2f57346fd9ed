"""The host buffer pool: power-of-two size classes reused across lengths, a real bound, per-device free lists,
a cgroup-aware default cap, and a failed allocation that is a refusal, not an exception."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ddp_patches.offload.pinned_pool import PinnedBufferPool, cgroup_limit_bytes, default_cap_bytes, size_class

KIB = 1 << 10


def test_size_classes_are_powers_of_two():
    assert [size_class(n) for n in (1, 4096, 4097, 100_000)] == [4096, 4096, 8192, 131072]


def test_reuses_a_released_buffer_of_the_same_class():
    pool = PinnedBufferPool(64 * KIB, pin=False)
    a = pool.acquire(5000)
    pool.release(a)
    b = pool.acquire(7000)  # another length, same class
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1 and pool.reused == 1
    assert pool.owned_bytes == 8 * KIB and pool.in_use_bytes == 8 * KIB


def test_a_larger_free_buffer_serves_a_smaller_request():
    pool = PinnedBufferPool(16 * KIB, pin=False)
    pool.release(pool.acquire(16 * KIB))
    assert pool.acquire(5 * KIB) is not None and pool.allocations == 1


def test_varying_lengths_reuse_instead_of_allocating():
    """Per-batch padding: 60 steps of random lengths, 27 layer inputs each (the issue measured 1,616 fresh
    allocations out of 1,620 requests with exact-size buffers)."""
    rng = random.Random(0)
    no_memory = lambda n: torch.empty(1, dtype=torch.uint8).expand(n)  # noqa: E731 - a buffer of n bytes, 1 real
    pool = PinnedBufferPool(1 << 40, pin=False, allocate=no_memory)
    requests = 0
    for _ in range(60):
        tokens = rng.randint(300, 2048)
        bufs = [pool.acquire(tokens * 896 * 2) for _ in range(27)]
        requests += len(bufs)
        for b in bufs:
            pool.release(b)
    assert requests == 1620 and pool.allocations <= 27 * 3  # a few classes' worth, once
    assert pool.owned_bytes <= 27 * size_class(2048 * 896 * 2)


def test_refuses_beyond_the_cap_and_never_exceeds_it():
    pool = PinnedBufferPool(8 * KIB, pin=False)
    assert pool.acquire(4 * KIB) is not None and pool.acquire(4 * KIB) is not None
    assert pool.acquire(1) is None
    assert pool.refused == 1 and pool.owned_bytes == 8 * KIB == pool.peak_owned_bytes


def test_free_buffers_are_not_dropped_to_make_room():
    """torch's caching host allocator keeps what it reserved: dropping a buffer frees nothing real."""
    pool = PinnedBufferPool(8 * KIB, pin=False)
    pool.release(pool.acquire(8 * KIB))
    assert pool.acquire(16 * KIB) is None and pool.owned_bytes == 8 * KIB


def test_a_failed_allocation_is_a_refusal():
    def fail(n):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    pool = PinnedBufferPool(1 << 30, pin=False, allocate=fail)
    assert pool.acquire(KIB) is None
    assert pool.failed == 1 and pool.owned_bytes == 0 and "cudaHostAlloc" in pool.last_error


def test_free_lists_are_per_device():
    """A buffer last read by one device's copy stream is never handed to another device's."""
    pool = PinnedBufferPool(1 << 20, pin=False)
    a = pool.acquire(KIB, torch.device("cuda", 0))
    pool.release(a, torch.device("cuda", 0))
    b = pool.acquire(KIB, torch.device("cuda", 1))
    c = pool.acquire(KIB, "cuda:0")
    assert b.data_ptr() != a.data_ptr() and c.data_ptr() == a.data_ptr()


def test_cap_is_split_between_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_cap_bytes(cgroup_files=())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_cap_bytes(cgroup_files=()) == one // 8


def test_cap_respects_the_cgroup_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    v2 = tmp_path / "memory.max"
    v2.write_text("4294967296\n")  # a 4 GiB container on a larger host
    assert cgroup_limit_bytes((str(v2),)) == 4 << 30
    assert default_cap_bytes(cgroup_files=(str(v2),)) == (4 << 30) // 4 // 2
    v2.write_text("max\n")
    assert cgroup_limit_bytes((str(v2),)) is None
    v1 = tmp_path / "limit_in_bytes"
    v1.write_text(str((1 << 63) - 4096))  # cgroup v1's "no limit"
    assert cgroup_limit_bytes((str(v1),)) is None


def test_negative_cap_is_an_error():
    with pytest.raises(ValueError, match="cap_bytes must be >= 0"):
        PinnedBufferPool(-1, pin=False)


# -- pinning ahead (NOTE [Pinning ahead]) ------------------------------------------------------------------------
class RecordingAllocate:
    """An ``allocate`` that records which thread pinned each buffer (the forward's, or the pinning-ahead one)."""

    def __init__(self):
        self.threads: list[str] = []

    def __call__(self, n):
        self.threads.append(threading.current_thread().name)
        return torch.empty(n, dtype=torch.uint8)


def test_a_growing_class_is_pinned_ahead_off_the_callers_thread():
    allocate = RecordingAllocate()
    pool = PinnedBufferPool(1 << 20, pin=False, allocate=allocate, prepin_ahead=2)
    held = [pool.acquire(5000)]  # the first request of a class: pinned inside it, as lazily
    for _ in range(5):
        pool.join_prepin()  # a layer's compute outlasting the pinning
        held.append(pool.acquire(5000))
    pool.join_prepin()
    inside = allocate.threads.count(threading.current_thread().name)
    assert inside == 1 and pool.allocations == 1 and pool.allocated_ahead == 7  # 5 taken + 2 still free
    assert pool.free_bytes() == 2 * 8 * KIB  # what stays unused when the growth stops: prepin_ahead buffers
    for b in held:
        pool.release(b)
    before = pool.allocated_ahead
    for _ in range(2):  # a later step reuses its buffers: nothing more is pinned
        held = [pool.acquire(5000) for _ in range(6)]
        pool.join_prepin()
        for b in held:
            pool.release(b)
    assert pool.allocated_ahead == before and pool.allocations == 1


def test_pinning_ahead_respects_the_cap_and_stops_on_a_failure():
    pool = PinnedBufferPool(3 * 8 * KIB, pin=False, prepin_ahead=4)
    held = [pool.acquire(5000)]
    pool.join_prepin()
    assert pool.owned_bytes == 3 * 8 * KIB == pool.peak_owned_bytes  # 2 ahead, not 4: the cap
    held += [pool.acquire(5000), pool.acquire(5000)]
    assert pool.acquire(5000) is None and pool.owned_bytes <= pool.cap_bytes

    calls = []

    def fails_ahead(n):
        calls.append(n)
        if len(calls) > 1:
            raise RuntimeError("cudaHostAlloc refused")
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedBufferPool(1 << 20, pin=False, allocate=fails_ahead, prepin_ahead=2)
    assert pool.acquire(5000) is not None
    pool.join_prepin()
    assert pool.prepin_failed == 1 and pool.failed == 0 and pool.last_error is None  # not the pack's failure
    assert pool.owned_bytes == 8 * KIB and len(calls) == 2  # gave up after one failure, gave the bytes back


def test_reserve_pins_now_within_the_cap():
    pool = PinnedBufferPool(4 * 8 * KIB, pin=False)
    assert pool.reserve(5000, 6) == 4 and pool.allocated_ahead == 4 and pool.allocations == 0
    assert [pool.acquire(5000) is not None for _ in range(5)] == [True] * 4 + [False]
    assert pool.allocations == 0  # every request found a buffer pinned ahead


def test_negative_prepin_ahead_is_an_error():
    with pytest.raises(ValueError, match="prepin_ahead must be >= 0"):
        PinnedBufferPool(0, pin=False, prepin_ahead=-1)
