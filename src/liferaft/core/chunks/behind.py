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
- raw writes submitted as ``Write`` jobs are joined: a ``Write`` whose bytes follow the previous one's both in
  memory (one tensor storage) and in the file joins the run kept back on the submitting side, which goes to the
  I/O thread as one request of at most ``JOIN`` bytes (then each write's ``after``, a pool region's release, in
  order) when it reaches ``JOIN``, before any other job, at ``flush`` or ``kick``, and whenever the I/O thread
  has nothing else to run: it takes the kept run itself the moment it is idle. So a run grows only while the
  device is busy, never holds back room the stager needs, and the device never waits for the writer to notice
  that it is idle (when the writer sent its kept run whenever the stager waited for room, as it did at first,
  the pool was full in every disk-bound save and 512 chunks of 1 MiB went as 129-153 requests of about 1 MiB;
  now as 65-68, 61 of them of 8 MiB). The 1 MiB pieces of consecutive chunks staged one after the other in the
  pool then reach the device as requests of several MiB (O_DIRECT from the pool's huge pages here: 2.5 GB/s in
  2 MiB requests, 3.2 in 8 MiB ones); ``close`` drops the kept run;
- memory stays bounded: a job holds a pool region until it has run (the stager cannot take more than the pool
  holds), and memory a job holds besides (``submit(..., holds=n)``: a chunk's encoded frames) is bounded by
  ``limit``: ``submit`` waits until the jobs queued before hold less than ``limit`` (or none), so that at most
  ``limit`` bytes plus one job's wait for the I/O thread however slow the storage.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

LIMIT = 64 << 20        # bytes that queued jobs may hold besides pool regions (``submit(holds=...)``)
JOIN = 8 << 20          # the most bytes of consecutive ``Write`` jobs joined into one request


@dataclass(eq=False)
class Write:
    """A job writing ``data`` (a contiguous uint8 CPU tensor) at ``offset`` with ``put(view, offset)``, then calling
    ``after`` (a pool region's release); joinable with the ``Write`` jobs that follow it (``follows``)."""

    put: Callable[[memoryview, int], None]
    data: torch.Tensor
    offset: int
    after: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or not self.data.is_contiguous() \
                or self.data.device.type != "cpu":
            raise ValueError("Write: data must be a contiguous 1-D uint8 CPU tensor (its bytes)")

    def follows(self, prev: Write) -> bool:
        """Whether this write's bytes come right after ``prev``'s, in memory (the same storage) and in the file,
        to the same ``put``."""
        n = prev.data.numel()
        return self.put == prev.put and self.offset == prev.offset + n and \
            self.data.data_ptr() == prev.data.data_ptr() + n and \
            self.data.untyped_storage().data_ptr() == prev.data.untyped_storage().data_ptr()



class _Joined:
    """Consecutive ``Write`` jobs (each ``follows`` the one before) as one job: one request, then each ``after``
    in order."""

    def __init__(self, first: Write) -> None:
        self.writes = [first]
        self.size = first.data.numel()

    def __call__(self) -> None:
        first = self.writes[0]
        data = first.data if len(self.writes) == 1 else first.data.as_strided((self.size,), (1,))  # (bounds-checked)
        first.put(memoryview(data.numpy()), first.offset)
        del data
        for w in self.writes:
            if w.after is not None:
                w.after()


class WriteBehind:
    """One I/O thread running write jobs in submission order (started at the first ``submit``)."""

    def __init__(self, limit: int | None = None) -> None:
        self._jobs: deque[tuple[Callable[[], None], int]] = deque()   # sent, not yet taken by the I/O thread
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._done = threading.Condition()      # guards everything below and ``_jobs``
        self._submitted = 0
        self._finished = 0
        self._held = 0              # bytes the queued and running jobs hold (``submit(holds=...)``)
        self.limit = LIMIT if limit is None else limit
        self.seconds = 0.0          # spent running jobs (read after ``flush``)
        self._run_kept: _Joined | None = None   # consecutive writes not yet sent (``submit``, ``kick``)

    def _take(self) -> tuple[Callable[[], None], int] | None:
        """The next job for the I/O thread: the oldest sent, else the run kept back (taken the moment the thread
        is idle, so the device never waits for the writer to notice), else wait; None once closed."""
        with self._done:
            while not self._jobs and self._run_kept is None and not self._stop:
                self._done.wait()
            if self._stop:
                return None
            if self._jobs:
                return self._jobs.popleft()
            run, self._run_kept = self._run_kept, None
            self._submitted += 1
            return run, 0

    def _run(self) -> None:
        while True:
            item = self._take()
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
        while the jobs queued before hold ``limit`` bytes or more. A ``Write`` that ``follows`` the run of writes
        kept back joins it (``JOIN`` bytes at most) instead; any other job sends that run first."""
        if self._error is not None:
            raise self._error
        self._start()
        if isinstance(job, Write) and not holds:
            with self._done:
                run = self._run_kept
                if run is not None and job.follows(run.writes[-1]) and run.size + job.data.numel() <= JOIN:
                    run.writes.append(job)
                    run.size += job.data.numel()
                else:
                    self._send_kept()
                    self._run_kept = _Joined(job)
                if self._run_kept.size >= JOIN:
                    self._send_kept()
                self._done.notify_all()
            return
        self.kick()
        self._queue(job, holds)

    def kick(self) -> None:
        """Send the run of writes kept back (``submit``) to the I/O thread now, behind the jobs sent before it (an
        idle I/O thread takes it by itself; ``flush`` sends it too)."""
        with self._done:
            self._send_kept()
            self._done.notify_all()

    def _send_kept(self) -> None:
        """(holding ``_done``) The run kept back, if any, sent after the jobs sent before it."""
        run, self._run_kept = self._run_kept, None
        if run is not None:
            self._submitted += 1
            self._jobs.append((run, 0))

    def _start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="liferaft-write", daemon=True)
            self._thread.start()

    def _queue(self, job: Callable[[], None], holds: int) -> None:
        with self._done:
            if holds:
                while self._held and self._held + holds > self.limit and self._error is None:
                    self._done.wait()
                if self._error is not None:
                    raise self._error
            self._held += holds
            self._submitted += 1
            self._jobs.append((job, holds))
            self._done.notify_all()

    def check(self) -> None:
        """Raise the first error of a job that has run, if any (without waiting)."""
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until every submitted job has run (the writes kept back sent first); raise the first error of any."""
        with self._done:
            if self._error is None:
                self._send_kept()
                self._done.notify_all()
            while self._finished < self._submitted and self._thread is not None:
                self._done.wait()
        if self._error is not None:
            raise self._error

    @property
    def busy(self) -> bool:
        """Whether a job sent to the I/O thread has not run yet (the writes kept back not counted)."""
        with self._done:
            return self._finished < self._submitted

    def __bool__(self) -> bool:
        with self._done:
            return self._run_kept is not None or self._finished < self._submitted

    def close(self) -> None:
        """Stop the thread once the job it is running (if any) has ended; queued jobs are dropped. Raises nothing."""
        with self._done:
            self._run_kept = None                   # (never sent: the save failed)
            if self._thread is None:
                return
            if self._error is None:
                self._error = RuntimeError("write-behind closed")    # (queued jobs are skipped from here on)
            self._stop = True
            self._done.notify_all()
        self._thread.join()
        self._thread = None
        with self._done:            # (the jobs dropped count as finished: nothing is left running or queued)
            self._jobs.clear()
            self._finished, self._held = self._submitted, 0
            self._done.notify_all()             # (a flush waiting in another thread returns, raising the error)
