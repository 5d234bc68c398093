"""storage.iobuf: O_DIRECT buffers of transparent huge pages, and the allocation every I/O buffer goes through
(``staging.pool.page_aligned_empty``)."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

from liferaft.staging.pool import PAGE, BufferPool, page_aligned_empty
from liferaft.storage.iobuf import HUGE, HUGE_FROM, huge_buffer

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    try:
        with open(THP) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _address(view: memoryview) -> int:
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _huge_kib_at(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``addr``."""
    found, kib = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "AnonHugePages:":
                kib += int(line.split()[1])
    return kib


@pytest.mark.parametrize("phase", [0, 64, PAGE - 1, HUGE - 1])
def test_huge_buffer_lies_phase_bytes_past_a_huge_page_and_is_zeroed(phase):
    v = huge_buffer(3 * HUGE + 5, phase)
    assert len(v) == 3 * HUGE + 5 and not v.readonly
    assert _address(v) % HUGE == phase
    assert bytes(v[:4096]) == bytes(4096) and bytes(v[-4096:]) == bytes(4096)
    v[-1] = 7
    assert v[-1] == 7


@pytest.mark.parametrize("nbytes, phase", [(0, 0), (-1, 0), (10, -1), (10, HUGE)])
def test_huge_buffer_refuses_bad_sizes(nbytes, phase):
    with pytest.raises(ValueError, match="huge_buffer"):
        huge_buffer(nbytes, phase)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="this kernel gives no transparent huge pages")
def test_touched_huge_buffer_is_backed_by_huge_pages():
    """What the module is for: with THP ``madvise`` (these machines) the memory is huge pages once touched (a
    kernel out of huge pages may give some 4 KiB ones: at least one huge page of the four is asked)."""
    v = huge_buffer(4 * HUGE)
    v[:] = b"\1" * len(v)
    assert _huge_kib_at(_address(v)) >= HUGE // 1024


@pytest.mark.parametrize("phase", [0, 64])
def test_large_io_buffers_are_huge_buffers_kept_alive_by_their_tensor(phase):
    t = page_aligned_empty(HUGE_FROM + 12345, phase=phase)
    assert t.dtype == torch.uint8 and t.numel() == HUGE_FROM + 12345
    assert t.data_ptr() % HUGE == phase            # (from ``huge_buffer``: page aligned, and huge-page aligned)
    t.fill_(3)
    gc.collect()                                   # (no other reference to the mapping than the tensor's)
    assert int(t[-1]) == 3 and int(t.sum()) == 3 * t.numel()
    view = t[100:200]                              # a view of it keeps the mapping alive too
    del t
    gc.collect()
    assert int(view.sum()) == 300


def test_small_and_pinned_buffers_keep_torchs_allocation():
    small = page_aligned_empty(HUGE_FROM - 1, phase=64)
    assert small.data_ptr() % PAGE == 64 and small.numel() == HUGE_FROM - 1


def test_pool_buffer_is_huge_and_o_direct_round_trips(tmp_path):
    """The save pool's memory (the largest I/O buffer) comes from ``huge_buffer``, and an O_DIRECT write from it
    and a read back into a huge read buffer give the bytes back."""
    pool = BufferPool(8 << 20)
    assert pool.buffer.data_ptr() % PAGE == pool.buffer.data_ptr() % HUGE
    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    start = (-pool.buffer.data_ptr()) % PAGE
    n = 4 << 20
    pool.buffer[start:start + n].copy_(data[:n])
    path = os.path.join(tmp_path, "f")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        assert os.pwrite(fd, memoryview(pool.buffer[start:start + n].numpy()), 0) == n
    finally:
        os.close(fd)
    back = page_aligned_empty(n)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [memoryview(back.numpy())], 0) == n
    finally:
        os.close(fd)
    assert torch.equal(back, data[:n])
