"""A slot file of the per-step log's ring (``tiers.steplog``), open for writing and mapped into memory."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from liferaft.errors import FileAccessError
from liferaft.storage.files import create_exclusive


class Slot:
    """One slot file of a ring open for writing (created, and preallocated, the first time this run uses it),
    mapped into memory: a record's bytes are copied in with one memcpy each (a ``pwrite`` into shared memory
    costs about four memcpys), and a slot's pages stay mapped from one record to the next.

    A replica that leaves ranges unwritten (held gradients, ``tiers.stepsend``) reserves with those ``holes``:
    their whole pages are neither allocated nor, once ``punch`` has run, kept, so such a replica takes the
    memory of what it holds, not of the whole record. Every other byte of ``[0, capacity)`` stays allocated, so
    that no write the caller makes outside its holes can meet a full ``/dev/shm`` as a SIGBUS."""

    def __init__(self, root: str, rel: str) -> None:
        self.path = os.path.join(root, rel)
        self.fd, dir_fd = create_exclusive(root, rel, readable=True)
        os.close(dir_fd)
        self.capacity = 0
        self.map: mmap.mmap | None = None
        self.sparse: list[tuple[int, int]] = []     # page ranges of [0, capacity) not allocated (or punched)
        self._old: list[mmap.mmap] = []      # outgrown mappings (closed with the slot)
        self._lock = threading.Lock()        # (the training thread and the replication thread both reserve)

    def reserve(self, size: int, whole: bool = False, holes: Sequence[tuple[int, int]] = ()) -> None:
        """At least ``size`` bytes allocated and mapped (the pages allocated once: no first touch per record),
        but the whole pages inside ``holes`` ((offset, length) ranges the caller will not write: they may stay
        unallocated). ``whole``: ``size`` is a whole record's (a replica, the next record's slot reserved
        ahead): sized to it plus slack, so that a record a few bytes longer fits (a header grows by a step's
        digits, a learning rate's repr); otherwise a record being appended tensor by tensor: the slot doubles,
        so that it takes a few mappings, not one per tensor. Thread-safe; a slot never shrinks."""
        keep = _pages(holes)
        if size <= self.capacity and not self.sparse and not keep:
            return
        with self._lock:
            if size > self.capacity:
                self._grow(size, whole, keep)
            else:
                self._allocate(keep)

    def punch(self, holes: Sequence[tuple[int, int]]) -> None:
        """Give back the memory of the whole pages inside ``holes`` (reserved as holes before; bytes the caller
        does not need): they read as zeros after. Where the file system cannot (no ``fallocate`` punching),
        they stay allocated."""
        with self._lock:
            for off, n in _minus(_pages(holes), self.sparse):
                if off >= self.capacity:
                    continue
                n = min(n, self.capacity - off)
                if _fallocate is None or _fallocate(self.fd, _PUNCH, off, n) != 0:
                    return
                self.sparse = _union(self.sparse, [(off, n)])

    def _allocate(self, keep: list[tuple[int, int]]) -> None:
        """Allocate every sparse page of ``[0, capacity)`` outside ``keep`` (the holes left as they are)."""
        for off, n in _minus(self.sparse, keep):
            self._fallocate(off, n)
        self.sparse = _intersect(self.sparse, keep)

    def _fallocate(self, off: int, n: int) -> None:
        try:
            os.posix_fallocate(self.fd, off, n)   # allocated now: a full /dev/shm fails here, not as a SIGBUS
        except OSError as e:
            raise FileAccessError(e.errno, f"{self.path}: cannot reserve {off + n} bytes of shared memory for a "
                                  f"per-step record ({e.strerror}); give /dev/shm more room (docker: "
                                  "--shm-size) or lower StepLogOptions.max_steps (docs/STEPLOG.md)") from e

    def _grow(self, size: int, whole: bool, keep: list[tuple[int, int]]) -> None:
        want = size + max(_SLACK, size >> 6)
        if not whole:
            want = max(want, self.capacity * 2, 1 << 20)
        keep = _intersect(keep, [(0, want)])
        self._allocate(keep)
        grown = [(self.capacity, want - self.capacity)]
        for off, n in _minus(grown, keep):
            self._fallocate(off, n)
        self.sparse = _union(self.sparse, _intersect(grown, keep))
        if os.fstat(self.fd).st_size < want:    # (a hole at the end: the file must still reach want to be mapped)
            os.ftruncate(self.fd, want)
        if self.map is not None:
            self._old.append(self.map)
        # (MAP_POPULATE would allocate the holes: a slot with holes faults its pages in on first write instead)
        self.map = mmap.mmap(self.fd, want, flags=mmap.MAP_SHARED | (0 if self.sparse else _POPULATE))
        self.capacity = want

    def write(self, off: int, data: Any) -> None:
        """Copy the bytes ``data`` (any buffer) to offset ``off`` (reserved before)."""
        assert self.map is not None and off + len(data) <= self.capacity
        self.map[off:off + len(data)] = data

    def copy_in(self, off: int, src: torch.Tensor, on_piece: Callable[[memoryview], None],
                piece: int = 16 << 20) -> None:
        """Copy the bytes of the contiguous CPU tensor ``src`` to offset ``off`` (reserved before) with numpy's
        copy, which runs without the GIL and on this thread alone (``write``'s memcpy holds the GIL: on a
        background thread, that stalls a Python training loop for the whole copy), in pieces of ``piece`` bytes;
        ``on_piece`` sees each piece's bytes right after its copy (a streaming checksum, on bytes still in the
        CPU's cache). The mapping stays exported while it runs: a ``close`` meanwhile cannot unmap it."""
        n = src.numel() * src.element_size()
        assert self.map is not None and off + n <= self.capacity
        if not n:
            return
        flat = src.reshape(-1).view(torch.uint8).numpy()
        dst = np.frombuffer(self.map, dtype=np.uint8, count=n, offset=off)
        try:
            for i in range(0, n, piece):
                part = flat[i:i + piece]
                np.copyto(dst[i:i + piece], part)
                on_piece(memoryview(part))
        finally:
            del dst                         # (the export of the mapping)

    def close(self) -> None:
        for m in [*self._old, *([self.map] if self.map is not None else [])]:
            try:
                m.close()
            except BufferError:             # (a view still exported: the mapping goes with the object)
                pass
        self._old, self.map = [], None
        os.close(self.fd)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_SLACK = 64 << 10
_PAGE = 4096
_MAX_HOLES = 64         # a replica with more held runs than this keeps them allocated (the bookkeeping stays small)
_PUNCH = 0x02 | 0x01    # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _libc_fallocate() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate() if sys.platform.startswith("linux") else None


def _pages(holes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages inside ``holes``, as sorted, merged (offset, length) ranges; none past ``_MAX_HOLES``."""
    if len(holes) > _MAX_HOLES:
        return []
    out = []
    for off, n in holes:
        lo, hi = -(-off // _PAGE) * _PAGE, (off + n) // _PAGE * _PAGE
        if hi > lo:
            out.append((lo, hi - lo))
    return _union([], out)


def _union(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, n in sorted(a + b):
        if out and off <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], off + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        elif n > 0:
            out.append((off, n))
    return out


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for ao, an in a:
        for bo, bn in b:
            lo, hi = max(ao, bo), min(ao + an, bo + bn)
            if hi > lo:
                out.append((lo, hi - lo))
    return _union([], out)


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for ao, an in a:
        pos, end = ao, ao + an
        for bo, bn in sorted(b):
            if bo + bn <= pos or bo >= end:
                continue
            if bo > pos:
                out.append((pos, bo - pos))
            pos = max(pos, bo + bn)
        if end > pos:
            out.append((pos, end - pos))
    return out


__all__ = ["Slot"]
