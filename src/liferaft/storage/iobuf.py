"""Memory for O_DIRECT requests, backed by transparent huge pages where the kernel offers them.

An O_DIRECT request goes to the block device as bios of at most ``max_segments`` physically contiguous pieces
(``/sys/block/<dev>/queue/max_segments``: 254 on these VMs' virtio disk, with ``max_sectors_kb`` 4096). From a
buffer of 4 KiB pages every page is a piece, so a request leaves in bios of at most ~1 MiB; from 2 MiB pages a
piece is 2 MiB, and a bio carries up to ``max_sectors_kb``. Measured here, the same runs, 0.25-0.5 GiB in 8 MiB
requests: O_DIRECT reads from 4 KiB pages 0.87-1.6 GB/s against 1.95-2.9 from huge pages, writes + fsync 1.8-2.0
against 2.4-3.2 (one request in flight; with four the 4 KiB-page reads ran 1.1-1.6, the huge-page ones 2.0-2.6).
The page cache's own large folios are why a buffered read had looked faster than O_DIRECT on some hours.

``huge_buffer(n)`` maps ``n`` bytes of private anonymous memory and asks for huge pages (``MADV_HUGEPAGE``) for
the whole huge pages inside it before anything touches it: with the kernel's THP setting ``always`` or
``madvise`` the first touch of each takes one huge page. Its memory stays what it holds: the buffer starts
``PAGE - phase`` bytes before a huge-page boundary (``phase`` bytes into a page, as asked), so that only a part of
a page lies before its first whole huge page; a last, partial huge page is advised too only when at most
``PAGE`` bytes of it would lie past the buffer. The rest is 4 KiB pages, advised so (``MADV_NOHUGEPAGE``) for
a kernel whose THP setting is ``always``. Resident, a buffer then costs at most
``2 * PAGE`` bytes more than its size, as one from ``torch.empty`` does. Where there are no huge pages (THP
``never``, a process with THP disabled, no THP in the kernel, none free and none made by compaction) the same
memory is simply 4 KiB pages: nothing fails. Nothing is touched here: like ``torch.empty`` the memory costs
nothing until written or read into. The cost: where the kernel's ``defrag`` setting is ``madvise`` (the
default), a first touch may compact memory to make a huge page.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap

PAGE = mmap.PAGESIZE
HUGE_FROM = 2 << 20     # I/O buffers at least this large are ``huge_buffer``s (a smaller one holds no huge page)
#: and at most this large. Huge pages come from free memory in whole 2 MiB blocks, on these VMs memory the guest
#: had never touched, whose first touch the host backs at ~0.7 GB/s (4 KiB pages mostly come back from memory
#: freed a moment ago): an ``async_save`` pool of 0.48 GB as huge pages made a process's first save stall 1.3 s
#: instead of 0.2 (its later saves were 7 % faster: 0.30-0.33 s until durable against 0.33-0.37). A load's read
#: buffers (2 x 8 MiB), a sync save's ring (64 MiB) and the transfer buffers stay below it.
HUGE_MAX = (64 << 20) + 4 * PAGE       # (a 64 MiB buffer and the pages some add for alignment)
_THP = "/sys/kernel/mm/transparent_hugepage"
_PMD_SIZE = f"{_THP}/hpage_pmd_size"
_STATUS = "/proc/self/status"


def _setting(path: str) -> str | None:
    """The bracketed choice of a THP setting file ("always [madvise] never" -> "madvise"); None if unreadable."""
    try:
        with open(path, "rb") as f:
            text = f.read(128).decode("ascii", "replace")
    except OSError:
        return None
    lo, hi = text.find("["), text.find("]")
    return text[lo + 1:hi] if 0 <= lo < hi else None


@functools.cache
def huge_pages_offered() -> bool:
    """Whether this kernel gives this process transparent huge pages of ``huge_page_size()`` for memory advised
    for them, read once: the setting for that size (``hugepages-<size>kB/enabled``, where the kernel has one and
    it does not say ``inherit``), else the global one, is ``always`` or ``madvise``, and the process has not turned
    THP off (``prctl(PR_SET_THP_DISABLE)``, inherited by its children: ``THP_enabled: 0`` in /proc/self/status).
    False where the kernel has no THP or says ``never``. A True does not promise huge pages (none may be free):
    it is what a caller that would otherwise work around 4 KiB pages decides on."""
    size = _setting(f"{_THP}/hugepages-{huge_page_size() >> 10}kB/enabled")
    if size in (None, "inherit"):
        size = _setting(f"{_THP}/enabled")
    if size not in ("always", "madvise"):
        return False
    try:
        with open(_STATUS, "rb") as f:
            status = f.read(1 << 20)          # (long with many supplementary groups)
    except OSError:
        return True
    return b"\nTHP_enabled:\t0" not in status


@functools.cache
def huge_page_size() -> int:
    """The size of a transparent huge page on this machine (``hpage_pmd_size``: 2 MiB on x86-64 and on arm64
    with 4 KiB pages), read once; 2 MiB where the kernel does not say (no THP: the advice is then a no-op)."""
    try:
        with open(_PMD_SIZE, "rb") as f:
            size = int(f.read(32).strip())
    except (OSError, ValueError):
        return 2 << 20
    return size if size >= PAGE and size % PAGE == 0 and size <= 1 << 30 else 2 << 20


def huge_buffer(nbytes: int, phase: int = 0) -> memoryview:
    """A writable memoryview of ``nbytes`` (> 0) bytes of fresh private anonymous memory whose first byte lies
    ``phase`` (0 <= phase < PAGE) bytes past a page boundary, the whole huge pages inside it advised for huge
    pages (see the module). Untouched: its content is zeros on first read (like any fresh anonymous memory). The
    view keeps its mapping alive; the mapping is unmapped when the last view of it (or of a slice of it, a tensor
    made from it) is gone."""
    if nbytes <= 0 or not 0 <= phase < PAGE:
        raise ValueError(f"huge_buffer: nbytes must be > 0 and phase in [0, {PAGE}) (got {nbytes}, {phase})")
    huge = huge_page_size()
    lead = 0 if phase == 0 else huge - PAGE + phase      # where in a huge page the buffer starts
    m = mmap.mmap(-1, 2 * huge + nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(first)
    del first                                   # (its export of ``m``'s buffer)
    start = (-base) % huge + lead               # offset of the buffer in ``m``
    lo = start + (-(base + start)) % huge       # the first whole huge page inside it
    end = start + nbytes
    hi = end - (base + end) % huge              # the end of its last whole huge page
    if (base + end) % huge and huge - (base + end) % huge <= PAGE:
        hi += huge                              # (a last partial huge page that wastes at most a page)
    advise, refuse = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_NOHUGEPAGE", None)
    with contextlib.suppress(OSError):          # (EINVAL: a kernel without THP; the memory is 4 KiB pages then)
        if advise is not None and hi > lo:
            m.madvise(advise, lo, hi - lo)
        if refuse is not None:                  # (THP "always": nothing outside [lo, hi) becomes a huge page)
            m.madvise(refuse, 0, lo)
            if hi < len(m):
                m.madvise(refuse, hi, len(m) - hi)
    return memoryview(m)[start:end]
