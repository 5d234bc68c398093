"""A slot file of the per-step log's ring (``tiers.steplog``), open for writing and mapped into memory."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

from liferaft.errors import FileAccessError
from liferaft.storage.files import create_exclusive


class Slot:
    """One slot file of a ring open for writing (created, and preallocated, the first time this run uses it),
    mapped into memory: a record's bytes are copied in with one memcpy each (a ``pwrite`` into shared memory
    costs about four memcpys), and a slot's pages stay mapped from one record to the next."""

    def __init__(self, root: str, rel: str) -> None:
        self.path = os.path.join(root, rel)
        self.fd, dir_fd = create_exclusive(root, rel, readable=True)
        os.close(dir_fd)
        self.capacity = 0
        self.map: mmap.mmap | None = None
        self._old: list[mmap.mmap] = []      # outgrown mappings (closed with the slot)
        self._lock = threading.Lock()        # (the training thread and the replication thread both reserve)

    def reserve(self, size: int, whole: bool = False) -> None:
        """At least ``size`` bytes allocated and mapped (the pages allocated once: no first touch per record).
        ``whole``: ``size`` is a whole record's (a replica, the next record's slot reserved ahead): sized to it
        plus slack, so that a record a few bytes longer fits (a header grows by a step's digits, a learning
        rate's repr); otherwise a record being appended tensor by tensor: the slot doubles, so that it takes
        a few mappings, not one per tensor. Thread-safe; a slot never shrinks."""
        if size <= self.capacity:
            return
        with self._lock:
            self._grow(size, whole)

    def _grow(self, size: int, whole: bool) -> None:
        if size > self.capacity:
            want = size + max(_SLACK, size >> 6)
            if not whole:
                want = max(want, self.capacity * 2, 1 << 20)
            try:
                os.posix_fallocate(self.fd, 0, want)  # allocated now: a full /dev/shm fails here, not as a SIGBUS
            except OSError as e:
                raise FileAccessError(e.errno, f"{self.path}: cannot reserve {want} bytes of shared memory for a "
                                      f"per-step record ({e.strerror}); give /dev/shm more room (docker: "
                                      "--shm-size) or lower StepLogOptions.max_steps (docs/STEPLOG.md)") from e
            if self.map is not None:
                self._old.append(self.map)
            self.map = mmap.mmap(self.fd, want, flags=mmap.MAP_SHARED | _POPULATE)
            self.capacity = want

    def write(self, off: int, data: Any) -> None:
        """Copy the bytes ``data`` (any buffer) to offset ``off`` (reserved before)."""
        assert self.map is not None and off + len(data) <= self.capacity
        self.map[off:off + len(data)] = data

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


__all__ = ["Slot"]
