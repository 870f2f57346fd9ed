"""The host buffer pool: exact-size reuse across steps, a hard cap, and room made from unused sizes."""

from __future__ import annotations

import pytest

from ddp_patches.pinned_pool import PinnedBufferPool, default_cap_bytes


def test_reuses_a_released_buffer_of_the_same_size():
    pool = PinnedBufferPool(1024, pin=False)
    a = pool.acquire(256)
    pool.release(a)
    b = pool.acquire(256)
    assert b.data_ptr() == a.data_ptr()
    assert pool.owned_bytes == 256 and pool.in_use_bytes == 256


def test_refuses_beyond_the_cap():
    pool = PinnedBufferPool(512, pin=False)
    assert pool.acquire(256) is not None and pool.acquire(256) is not None
    assert pool.acquire(1) is None
    assert pool.refused == 1 and pool.owned_bytes == 512 and pool.peak_in_use_bytes == 512


def test_free_buffers_of_other_sizes_make_room():
    pool = PinnedBufferPool(512, pin=False)
    pool.release(pool.acquire(512))
    assert pool.acquire(300) is not None  # the free 512-byte buffer was dropped to stay under the cap
    assert pool.owned_bytes == 300


def test_cap_is_split_between_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_cap_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_cap_bytes() == one // 8


def test_negative_cap_is_an_error():
    with pytest.raises(ValueError, match="cap_bytes must be >= 0"):
        PinnedBufferPool(-1, pin=False)
