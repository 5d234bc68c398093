"""A ring buffer of host memory, reused across saves, that never holds more than its capacity.

Regions are taken in order by one producer (the stager) and given back in the same order by one consumer
(the writer), so a ring is exact: a producer that finds no room waits until the consumer frees the oldest
region. The memory is allocated once and kept, so after the first save no copy touches fresh pages (on these
VMs first touch runs at ~1 GB/s, a copy into touched memory at ~11 GB/s). On CUDA hosts it is pinned.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from liferaft.errors import LiferaftError
from liferaft.planning.save_plan import PAGE_PHASE
from liferaft.storage.iobuf import HUGE_FROM, HUGE_MAX, huge_buffer, huge_page_size, huge_pages_offered

ALIGN = 64            # every region starts at a multiple of this
PAGE = 4096           # regions asked for with align=PAGE lie PAGE_PHASE bytes into a page (as large chunks in files)


def page_aligned_empty(nbytes: int, pin: bool = False, phase: int = 0) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose first byte lies ``phase`` bytes past a page boundary (0:
    page aligned, usable with O_DIRECT). Unpinned and of ``HUGE_FROM`` to ``HUGE_MAX`` bytes, its whole huge pages are
    advised for transparent huge pages (``storage.iobuf``: an O_DIRECT request from them reaches the device in
    2 MiB pieces instead of 4 KiB ones; 1.3-2.5x the read speed here); pinned, it is what torch's pinned
    allocator gives."""
    if not pin and HUGE_FROM <= nbytes <= HUGE_MAX:
        return torch.frombuffer(huge_buffer(nbytes, phase), dtype=torch.uint8)
    raw = torch.empty(nbytes + PAGE + phase, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE + phase
    return raw[skip:skip + nbytes]


class PoolClosedError(LiferaftError):
    """The pool was reset while a producer waited for room (the save it served failed)."""


class BufferPool:
    """``capacity`` bytes of host memory handed out as aligned, FIFO-released regions."""

    def __init__(self, capacity: int, pin: bool = False) -> None:
        self.capacity = max(PAGE, -(-capacity // PAGE) * PAGE)
        self.pinned = pin
        # (``PAGE_PHASE`` bytes into a page: a region at a multiple of PAGE lies in memory as a large chunk's range
        # lies in its data file, ``planning.save_plan.place``, so that its whole pages go to storage with O_DIRECT)
        self.buffer = page_aligned_empty(self.capacity, pin, PAGE_PHASE)
        #: whether ``buffer`` is a ``huge_buffer`` large enough for a huge page, where the kernel offers them to this
        #: process (``iobuf.huge_pages_offered``): O_DIRECT from it reaches the device in large pieces, and
        #: ``core.chunks.writer.write_streamed`` copies into it rather than write large tensors in place
        self.huge = not pin and HUGE_FROM <= self.capacity <= HUGE_MAX and huge_page_size() <= self.capacity \
            and huge_pages_offered()
        self._cond = threading.Condition()
        self._live: deque[tuple[int, int]] = deque()   # (start, size) in allocation order
        self._head = 0
        self._generation = 0                          # bumped by reset(): waiting producers give up
        self.waiting = 0                              # producers currently waiting for room
        self.high_water = 0                           # most bytes in use at once since creation

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._used()

    def _used(self) -> int:
        if not self._live:
            return 0
        start = self._live[0][0]
        end = self._head
        return end - start if end > start else self.capacity - start + end

    def _fit(self, n: int, align: int, at: int = 0) -> int | None:
        """Where a region of ``n`` bytes starting ``at`` bytes past a multiple of ``align`` fits now, else at a
        multiple of ``align`` (written through the page cache then, never refused: a region as large as the pool
        fits an empty pool); None: nowhere until regions are released."""
        got = self._fit_at(n, align, at)
        return got if got is not None or not at else self._fit_at(n, align, 0)

    def _fit_at(self, n: int, align: int, at: int) -> int | None:
        if not self._live:
            return at if at + n <= self.capacity else None
        tail = self._live[0][0]
        head = -(-(self._head - at) // align) * align + at
        if self._head > tail:
            if head + n <= self.capacity:
                return head
            return at if at + n <= tail else None
        return head if head + n <= tail else None

    @property
    def generation(self) -> int:
        """Bumped by every ``reset()``: a producer that started before a reset must stop."""
        return self._generation

    def acquire(self, nbytes: int, timeout: float | None = None, align: int = ALIGN,
                generation: int | None = None, phase: int = PAGE_PHASE) -> tuple[int, torch.Tensor]:
        """A region of ``nbytes`` (≤ capacity) as ``(start, uint8 tensor view)``, at a multiple of ``align`` (64 or
        4096); with ``align`` a page, its memory lies ``phase`` bytes into a page (``PAGE_PHASE``: the region starts
        at a multiple of a page of the pool, whose buffer starts that far into a page; 0: a page earlier, for files
        whose large chunks start on a page). Waits for room. Raises PoolClosedError if the pool was reset since
        ``generation`` (or while waiting)."""
        size = self._size(nbytes)
        at = (phase - PAGE_PHASE) % align if align == PAGE else 0
        with self._cond:
            if generation is None:
                generation = self._generation
            while True:
                if self._generation != generation:
                    raise PoolClosedError("the buffer pool was reset while waiting for room")
                start = self._fit(min(size, self.capacity), align, at)
                if start is not None:
                    break
                self.waiting += 1
                try:
                    if not self._cond.wait(timeout):
                        raise TimeoutError(f"no room for {nbytes} bytes in the buffer pool within {timeout}s")
                finally:
                    self.waiting -= 1
            self._take(start, size)
        return start, self.buffer[start:start + nbytes]

    def try_acquire(self, nbytes: int, align: int = ALIGN, generation: int | None = None,
                    phase: int = PAGE_PHASE) -> tuple[int, torch.Tensor] | None:
        """As ``acquire``, but None at once when there is no room now (never waits, never counts as waiting)."""
        size = self._size(nbytes)
        at = (phase - PAGE_PHASE) % align if align == PAGE else 0
        with self._cond:
            if generation is not None and self._generation != generation:
                raise PoolClosedError("the buffer pool was reset")
            start = self._fit(min(size, self.capacity), align, at)
            if start is None:
                return None
            self._take(start, size)
        return start, self.buffer[start:start + nbytes]

    def _size(self, nbytes: int) -> int:
        """The bytes a request of ``nbytes`` takes (ValueError past the capacity)."""
        if nbytes > self.capacity:
            raise ValueError(f"request of {nbytes} bytes exceeds the pool capacity {self.capacity}")
        return -(-max(nbytes, 1) // ALIGN) * ALIGN

    def _take(self, start: int, size: int) -> None:
        size = min(size, self.capacity - start)
        self._live.append((start, size))
        self._head = start + size
        self.high_water = max(self.high_water, self._used())

    def release(self, start: int) -> None:
        """Give back the oldest region (which must start at ``start``)."""
        with self._cond:
            if not self._live or self._live[0][0] != start:
                raise RuntimeError("buffer pool regions must be released in the order they were acquired")
            self._live.popleft()
            if not self._live:
                self._head = 0
            self._cond.notify_all()

    def reset(self) -> None:
        """Drop every region (after a failed save) and wake any waiting producer with PoolClosedError."""
        with self._cond:
            self._live.clear()
            self._head = 0
            self._generation += 1
            self._cond.notify_all()

    def touch(self) -> None:
        """Fault every page in now (one-time cost), so that the first snapshot copies at memory speed."""
        self.buffer.zero_()
