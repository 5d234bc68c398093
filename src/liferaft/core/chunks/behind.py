"""Writes behind the hashing: one I/O thread writes the raw pieces and the encoded frames of a save while the
writer hashes the next pieces (and the codec threads encode the next chunks).

Without it the writer thread alternated: hash a staged piece (CRC-32C blocks and the 64-bit digest), then wait
for its ``pwrite``, then hash the next — the device idled while the CPU hashed, and a 1 GB save took the write
time plus the hashing time (measured: 0.15 s of a 1.2 s save). Here ``submit`` hands the write of a hashed piece
to a thread of its own and returns at once, so the disk writes of piece *i* overlap the hashing of piece *i + 1*
(and the staging of the ones after it, in the stager's thread).

Contract:
- jobs run one at a time, in submission order, on one thread (the pool regions they release are given back in
  the order they were taken, which ``staging.BufferPool`` requires);
- ``flush`` returns once every job submitted has run, and raises the first error of any of them (after an error
  the jobs still queued are dropped, not run: the save fails, and the caller resets the pool);
- ``submit`` and ``check`` raise a job's earlier error at once (the writer stops hashing a save that already
  failed, and never waits for pool room that a dropped job would have given back);
- ``close`` stops the thread, running no further job and raising nothing (the error path: the caller raises its
  own error, then aborts the file — no write may still be running when the file is closed);
- memory stays bounded: a job holds a pool region until it has run (the stager cannot take more than the pool
  holds), and memory a job holds besides (``submit(..., holds=n)``: a chunk's encoded frames) is bounded by
  ``limit``: ``submit`` waits until the jobs queued before hold less than ``limit`` (or none), so that at most
  ``limit`` bytes plus one job's wait for the I/O thread however slow the storage.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

LIMIT = 64 << 20        # bytes that queued jobs may hold besides pool regions (``submit(holds=...)``)


class WriteBehind:
    """One I/O thread running write jobs in submission order (started at the first ``submit``)."""

    def __init__(self, limit: int | None = None) -> None:
        self._q: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._held = 0              # bytes the queued and running jobs hold (``submit(holds=...)``)
        self.limit = LIMIT if limit is None else limit
        self.seconds = 0.0          # spent running jobs (read after ``flush``)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, holds = item
            if self._error is None:
                t0 = time.perf_counter()
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by flush/submit
                    self._error = e
                self.seconds += time.perf_counter() - t0
            del job, item               # (what it held is freed before it is counted out)
            with self._done:
                self._finished += 1
                self._held -= holds
                self._done.notify_all()

    def submit(self, job: Callable[[], None], holds: int = 0) -> None:
        """Run ``job`` after the jobs submitted before it, on the I/O thread; raises an earlier job's error.
        ``holds``: bytes ``job`` keeps alive until it has run besides pool regions (encoded frames); first waits
        while the jobs queued before hold ``limit`` bytes or more."""
        if self._error is not None:
            raise self._error
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="liferaft-write", daemon=True)
            self._thread.start()
        if holds:
            with self._done:
                while self._held and self._held + holds > self.limit and self._error is None:
                    self._done.wait()
            if self._error is not None:
                raise self._error
        with self._done:
            self._held += holds
        self._submitted += 1
        self._q.put((job, holds))

    def check(self) -> None:
        """Raise the first error of a job that has run, if any (without waiting)."""
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until every submitted job has run; raise the first error of any."""
        with self._done:
            while self._finished < self._submitted:
                self._done.wait()
        if self._error is not None:
            raise self._error

    def __bool__(self) -> bool:
        return self._finished < self._submitted

    def close(self) -> None:
        """Stop the thread once the job it is running (if any) has ended; queued jobs are dropped. Raises nothing."""
        if self._thread is None:
            return
        if self._error is None:
            self._error = RuntimeError("write-behind closed")    # (queued jobs are skipped from here on)
        self._q.put(None)
        self._thread.join()
        self._thread = None
