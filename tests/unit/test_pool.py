import threading

import pytest

from liferaft.staging.pool import BufferPool, PoolClosedError


def test_ring_never_exceeds_capacity_and_wraps():
    pool = BufferPool(4096)                  # capacities are whole pages
    a, _ = pool.acquire(1590)
    b, _ = pool.acquire(1600)
    assert a == 0 and b == 1600              # 1590 rounded up to the 64-byte alignment
    got = []

    def producer():
        got.append(pool.acquire(1500))      # does not fit until the first region is released

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.2)
    assert t.is_alive() and pool.waiting == 1
    pool.release(a)
    t.join(5)
    start, view = got[0]
    assert start == 0 and view.numel() == 1500          # wrapped to the front
    assert pool.high_water <= pool.capacity


def test_release_must_be_fifo_and_reset_wakes_waiters():
    pool = BufferPool(4096)
    a, _ = pool.acquire(4000)
    with pytest.raises(RuntimeError):
        pool.release(a + 64)
    errors = []

    def producer():
        try:
            pool.acquire(4000)
        except PoolClosedError as e:
            errors.append(e)

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.2)
    pool.reset()
    t.join(5)
    assert errors and pool.in_use == 0
    assert pool.acquire(4096)[0] == 0


def test_oversized_request_is_refused():
    with pytest.raises(ValueError):
        BufferPool(128).acquire(4097)


def test_page_aligned_regions_for_direct_io():
    """A region at a multiple of a page lies 64 bytes into a page of memory: where a large chunk's range lies in
    its data file (planning.save_plan.place), so that its whole pages go to storage with O_DIRECT."""
    pool = BufferPool(1 << 20)
    assert pool.buffer.data_ptr() % 4096 == 64
    pool.acquire(100)
    start, view = pool.acquire(70000, align=4096)
    assert start == 4096 and view.data_ptr() % 4096 == 64


def test_try_acquire_never_waits_and_takes_what_acquire_would():
    pool = BufferPool(8192)
    a = pool.try_acquire(4000)
    assert a is not None and a[0] == 0
    assert pool.try_acquire(5000) is None and pool.waiting == 0        # no room now: None at once, not a waiter
    b = pool.try_acquire(3000)
    assert b is not None and b[0] == 4032
    pool.release(0)
    c = pool.try_acquire(4000)
    assert c is not None and c[0] == 0                                  # wrapped around, as acquire would
    gen = pool.generation
    pool.reset()
    with pytest.raises(PoolClosedError):
        pool.try_acquire(10, generation=gen)


@pytest.mark.parametrize("one_thread", [False, True])
def test_one_thread_copies_are_the_bytes_of_the_range_asked_whatever_the_source(one_thread):
    """``stage``'s copies with ``one_thread`` (one memmove on the stager thread) give the bytes [a, b) of the
    source's row-major bytes, as torch's ``copy_`` does: a contiguous view at an offset into its storage, a range in
    the middle, a 0-d tensor; a source that is not contiguous goes by rows through ``copy_`` either way."""
    import torch

    from liferaft.staging.stager import _copy, _ranges

    base = torch.arange(3 * 1000, dtype=torch.int32)
    sources = [base[1000:2000], base[1:2001].view(40, 50), torch.tensor(7.5), base.view(60, 50)[:, 10:30]]
    for src in sources:
        flat = src.contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        for a, b, rows in _ranges(src, n, 1000) + [(0, n, None)] * src.is_contiguous():
            view = torch.full((b - a,), 255, dtype=torch.uint8)
            assert _copy(src, view, a, b, rows, None, one_thread) is None
            assert torch.equal(view, flat[a:b]), (src.shape, a, b)


def test_the_one_thread_copy_is_one_memmove_and_a_storage_smaller_than_its_tensor_raises(monkeypatch):
    """With ``one_thread`` a contiguous host range is one ``memmove`` (not torch's parallel copy); a source whose
    storage was shrunk behind its back (FSDP frees parameters so) raises (torch bounds-checks the byte view),
    never reads past the storage (helper-126: the first version took the address from the tensor's claimed size: a crash, or heap
    bytes committed in a checkpoint that verified)."""
    import ctypes

    import torch

    from liferaft.staging import stager

    calls = []
    real = ctypes.memmove
    monkeypatch.setattr(stager.ctypes, "memmove", lambda d, s, n: (calls.append(n), real(d, s, n))[1])
    src = torch.arange(1 << 16, dtype=torch.float32)
    view = torch.empty(4096, dtype=torch.uint8)
    stager._copy(src, view, 8192, 12288, None, None, True)
    assert calls == [4096] and torch.equal(view, src.view(torch.uint8)[8192:12288])
    stager._copy(src, view, 8192, 12288, None, None, False)
    assert calls == [4096]                          # (copy_ when not asked)
    for keep in (0, 4096):
        t = torch.arange(1 << 16, dtype=torch.float32)
        t.untyped_storage().resize_(keep)
        with pytest.raises(RuntimeError, match="out of bounds"):
            stager._copy(t, view, 8192, 12288, None, None, True)
    assert calls == [4096]
