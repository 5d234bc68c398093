"""storage.iobuf: O_DIRECT buffers of transparent huge pages, and the allocation every I/O buffer goes through
(``staging.pool.page_aligned_empty``)."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

from liferaft.staging.pool import PAGE, BufferPool, page_aligned_empty
from liferaft.storage.iobuf import HUGE_FROM, HUGE_MAX, huge_buffer, huge_page_size

HUGE = huge_page_size()

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_off() -> str | None:
    """Why this process gets no transparent huge pages, or None."""
    try:
        with open(THP) as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "this kernel has no transparent huge pages"
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are {mode!r} on this machine"
    with open("/proc/self/status") as f:
        if any(line.split() == ["THP_enabled:", "0"] for line in f):
            return "transparent huge pages are disabled for this process (PR_SET_THP_DISABLE)"
    return None


def _address(view: memoryview) -> int:
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _mappings() -> list[tuple[int, int, set[str], int]]:
    """(start, end, VmFlags, AnonHugePages KiB) of each mapping of this process."""
    out: list[tuple[int, int, set[str], int]] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                out.append((lo, hi, set(), 0))
            elif head == "VmFlags:":
                out[-1][2].update(line.split()[1:])
            elif head == "AnonHugePages:":
                out[-1] = (*out[-1][:3], int(line.split()[1]))
    return out


def _advised(lo: int, hi: int) -> int:
    """Bytes of [lo, hi) in mappings advised for huge pages (VmFlags ``hg``)."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b, flags, _ in _mappings() if "hg" in flags)


@pytest.mark.parametrize("phase", [0, 64, PAGE - 1])
@pytest.mark.parametrize("nbytes", [5, HUGE - 1, HUGE, 3 * HUGE + 5, 8 * HUGE, 8 * HUGE - PAGE + 1])
def test_huge_buffer_lies_phase_bytes_into_a_page_and_is_zeroed(phase, nbytes):
    v = huge_buffer(nbytes, phase)
    assert len(v) == nbytes and not v.readonly
    assert _address(v) % PAGE == phase
    assert bytes(v[:4096]) == bytes(min(4096, nbytes)) and bytes(v[-4096:]) == bytes(min(4096, nbytes))
    v[-1] = 7
    assert v[-1] == 7


@pytest.mark.parametrize("phase", [0, 64, PAGE - 1])
@pytest.mark.parametrize("nbytes", [HUGE - 1, HUGE, 3 * HUGE + 5, 8 * HUGE, 8 * HUGE - PAGE + 1, 32 * HUGE + 64])
def test_only_the_huge_pages_inside_a_buffer_are_advised(phase, nbytes):
    """The memory a buffer may take stays its size: no huge page is advised that reaches more than a page past
    either end (a pool of 64 MiB took 66 with its whole span advised), and every whole huge page inside is."""
    v = huge_buffer(nbytes, phase)
    lo = _address(v)
    hi = lo + nbytes
    # (another buffer's advised pages lie at least a huge page minus a page away: each mapping has unadvised room
    # around its buffer)
    outside = _advised(lo - HUGE // 2, lo) + _advised(hi, hi + HUGE // 2)
    assert outside <= PAGE, outside
    whole = hi // HUGE * HUGE - -(-lo // HUGE) * HUGE
    assert _advised(lo, hi) >= max(0, whole)
    # (the room past the buffer is advised against huge pages, for a kernel whose THP setting is "always")
    past = hi + 2 * PAGE
    assert any(a <= past < b and "nh" in flags for a, b, flags, _ in _mappings())


@pytest.mark.parametrize("nbytes, phase", [(0, 0), (-1, 0), (10, -1), (10, PAGE)])
def test_huge_buffer_refuses_bad_sizes(nbytes, phase):
    with pytest.raises(ValueError, match="huge_buffer"):
        huge_buffer(nbytes, phase)


def test_touched_huge_buffer_is_backed_by_huge_pages():
    """What the module is for: with THP ``madvise`` (these machines) the memory is huge pages once touched (a
    kernel out of huge pages may give some 4 KiB ones: at least one huge page of the eight is asked)."""
    why = _thp_off()
    if why is not None:
        pytest.skip(why)
    v = huge_buffer(8 * HUGE)
    v[:] = b"\1" * len(v)
    addr = _address(v)
    assert sum(kib for a, b, _, kib in _mappings() if a <= addr < b or addr <= a < addr + len(v)) >= HUGE // 1024


def test_a_buffer_is_unmapped_with_its_last_view():
    t = page_aligned_empty(4 * HUGE)
    t.fill_(1)
    addr = t.data_ptr()
    assert any(a <= addr < b for a, b, _, _ in _mappings())
    view = t[10:20]
    del t
    gc.collect()
    assert int(view.sum()) == 10                # (a view keeps it mapped)
    del view
    gc.collect()
    assert not any(a <= addr < b and "hg" in flags for a, b, flags, _ in _mappings())


@pytest.mark.parametrize("phase", [0, 64])
def test_large_io_buffers_are_huge_buffers_kept_alive_by_their_tensor(phase):
    t = page_aligned_empty(HUGE_FROM + 12345, phase=phase)
    assert t.dtype == torch.uint8 and t.numel() == HUGE_FROM + 12345
    assert t.data_ptr() % PAGE == phase
    t.fill_(3)
    gc.collect()                                   # (no other reference to the mapping than the tensor's)
    assert int(t[-1]) == 3 and int(t.sum()) == 3 * t.numel()
    view = t[100:200]                              # a view of it keeps the mapping alive too
    del t
    gc.collect()
    assert int(view.sum()) == 300


def test_small_and_very_large_buffers_keep_torchs_allocation():
    small = page_aligned_empty(HUGE_FROM - 1, phase=64)
    assert small.data_ptr() % PAGE == 64 and small.numel() == HUGE_FROM - 1
    assert small.untyped_storage().nbytes() == HUGE_FROM - 1 + PAGE + 64       # (torch.empty's, sliced)
    large = page_aligned_empty(HUGE_FROM, phase=64)
    assert large.untyped_storage().nbytes() == HUGE_FROM                       # (the huge buffer's own)
    assert page_aligned_empty(HUGE_MAX).untyped_storage().nbytes() == HUGE_MAX
    # (an async save's pool of the state's size: huge pages from memory never touched cost a first save seconds)
    larger = page_aligned_empty(HUGE_MAX + 1)
    assert larger.untyped_storage().nbytes() == HUGE_MAX + 1 + PAGE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_buffers_keep_torchs_pinned_allocation():
    t = page_aligned_empty(4 * HUGE, pin=True, phase=64)
    assert t.is_pinned() and t.data_ptr() % PAGE == 64
    assert t.untyped_storage().nbytes() == 4 * HUGE + PAGE + 64


def test_pool_buffer_is_huge_and_o_direct_round_trips(tmp_path):
    """The save pool's memory (the largest I/O buffer) comes from ``huge_buffer``, and an O_DIRECT write from it
    and a read back into a huge read buffer give the bytes back."""
    pool = BufferPool(8 << 20)
    assert pool.buffer.untyped_storage().nbytes() == pool.capacity       # (a huge buffer, not torch.empty's)
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


@pytest.mark.parametrize("top, per_size, status, offered", [
    (b"always [madvise] never\n", None, None, True),
    (b"[always] madvise never\n", b"always [inherit] madvise never\n", None, True),
    (b"always madvise [never]\n", None, None, False),
    (b"always madvise [never]\n", b"always inherit [madvise] never\n", None, True),    # (the size's own choice)
    (b"always [madvise] never\n", b"always inherit madvise [never]\n", None, False),
    (b"always [madvise] never\n", None, b"Name:\tpython\nTHP_enabled:\t0\nThreads:\t1\n", False),  # (prctl)
    (b"always [madvise] never\n", None, b"Name:\tpython\nTHP_enabled:\t1\n", True),
    (b"always [madvise] never\n", None, b"Groups:\t" + b"1000 " * 5000 + b"\nTHP_enabled:\t0\n", False),  # (long)
    (b"", None, None, False), (b"x" * 200 + b"[madvise]", None, None, False), (None, None, None, False)])
def test_huge_pages_are_offered_only_where_the_kernel_gives_them_to_this_process(tmp_path, monkeypatch, top,
                                                                                 per_size, status, offered):
    """``huge_pages_offered`` reads the THP setting for the huge-page size where the kernel has one (else the
    global one) and whether the process turned THP off (``THP_enabled: 0``): a bounded read (a long or odd file is
    not taken as offering them; a missing one means no THP). A ring of huge pages is copied into rather than
    written around."""
    from liferaft.storage import iobuf

    thp = tmp_path / "thp"
    (thp / f"hugepages-{iobuf.huge_page_size() >> 10}kB").mkdir(parents=True)
    for path, text in ((thp / "enabled", top), (thp / f"hugepages-{iobuf.huge_page_size() >> 10}kB" / "enabled",
                                                 per_size), (tmp_path / "status", status)):
        if text is not None:
            path.write_bytes(text)
    monkeypatch.setattr(iobuf, "_THP", str(thp))
    monkeypatch.setattr(iobuf, "_STATUS", str(tmp_path / "status"))
    iobuf.huge_pages_offered.cache_clear()
    try:
        assert iobuf.huge_pages_offered() is offered
    finally:
        iobuf.huge_pages_offered.cache_clear()


@pytest.mark.parametrize("offered", [False, True])
def test_a_pool_is_huge_only_unpinned_within_the_huge_range_where_offered(monkeypatch, offered):
    from liferaft.staging import pool as pool_module

    monkeypatch.setattr(pool_module, "huge_pages_offered", lambda: offered)
    assert BufferPool(8 << 20).huge is offered
    assert BufferPool(64 << 20).huge is offered
    assert BufferPool(HUGE_FROM - PAGE).huge is False          # (torch's allocation: no whole huge page)
    assert BufferPool(HUGE_MAX + PAGE).huge is False           # (an async pool of 4 KiB pages)
    monkeypatch.setattr(pool_module, "huge_page_size", lambda: 512 << 20)     # (arm64 with 64 KiB pages)
    assert BufferPool(64 << 20).huge is False                   # (holds no whole huge page)
