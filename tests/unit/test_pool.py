import threading

import pytest

from liferaft.staging.pool import BufferPool, PoolClosedError


def test_ring_never_exceeds_capacity_and_wraps():
    pool = BufferPool(1024)
    a, _ = pool.acquire(400)
    b, _ = pool.acquire(400)
    assert a == 0 and b == 448  # 400 rounded up to the 64-byte alignment
    got = []

    def producer():
        got.append(pool.acquire(440))      # does not fit until the first region is released

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.2)
    assert t.is_alive() and pool.waiting == 1
    pool.release(a)
    t.join(5)
    start, view = got[0]
    assert start == 0 and view.numel() == 440          # wrapped to the front
    assert pool.high_water <= pool.capacity


def test_release_must_be_fifo_and_reset_wakes_waiters():
    pool = BufferPool(256)
    a, _ = pool.acquire(200)
    with pytest.raises(RuntimeError):
        pool.release(a + 64)
    errors = []

    def producer():
        try:
            pool.acquire(200)
        except PoolClosedError as e:
            errors.append(e)

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.2)
    pool.reset()
    t.join(5)
    assert errors and pool.in_use == 0
    assert pool.acquire(256)[0] == 0


def test_oversized_request_is_refused():
    with pytest.raises(ValueError):
        BufferPool(128).acquire(129)
