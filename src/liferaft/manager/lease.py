"""One writer per root: a lease object (``LEASE``) that the manager of a job holds while it may write there.

The holder (rank 0 of the job) rewrites the lease every ``ttl / 3`` seconds. Another job finding a lease refuses to
start unless the lease is its own (same ``job_id``: a restart of the same job), its holder is a dead process on this
host, or it was not renewed for ``ttl`` seconds (waiting up to ``ttl`` for that). This is detection, not a lock
service: two jobs that start within the same instant can both write the lease; each reads it back after writing
and before every save, so the loser finds out before its first commit.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from liferaft.errors import CheckpointBusyError
from liferaft.storage import Storage

LEASE = "LEASE"


@dataclass(frozen=True)
class LeaseInfo:
    job_id: str
    host: str
    pid: int
    renewed_unix: float
    token: str = ""         # one per Lease object: tells two managers of one process apart


def _read(storage: Storage) -> LeaseInfo | None:
    try:
        raw = json.loads(storage.read_all(LEASE))
        return LeaseInfo(job_id=str(raw["job_id"]), host=str(raw["host"]), pid=int(raw["pid"]),
                         renewed_unix=float(raw["renewed_unix"]), token=str(raw.get("token", "")))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None        # a damaged lease protects nothing: treat as absent


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of ``job_id`` on ``storage`` (acquire → renew in a thread → release)."""

    def __init__(self, storage: Storage, job_id: str, ttl: float = 30.0) -> None:
        self.storage = storage
        self.me = LeaseInfo(job_id=job_id, host=socket.gethostname(), pid=os.getpid(), renewed_unix=0.0,
                            token=uuid.uuid4().hex)
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _holder_gone(self, other: LeaseInfo) -> bool:
        if other.job_id == self.me.job_id:
            return True
        if other.host == self.me.host and not _pid_alive(other.pid):
            return True
        return time.time() - other.renewed_unix > self.ttl

    def acquire(self) -> None:
        """Take the lease, waiting up to ``ttl`` for another job's lease to go stale; raise CheckpointBusyError if
        that job keeps renewing it."""
        deadline = time.monotonic() + self.ttl + 1.0
        while True:
            other = _read(self.storage)
            if other is None or self._holder_gone(other):
                break
            if time.monotonic() > deadline:
                raise CheckpointBusyError(
                    f"{self.storage.url} is in use by job {other.job_id!r} (host {other.host}, pid {other.pid}, "
                    f"renewed {time.time() - other.renewed_unix:.0f} s ago); two jobs must not write the same root. "
                    "Stop the other job, or use another root (a restart of the same job passes the same job_id)")
            time.sleep(min(1.0, self.ttl / 10))
        self._write()
        self.check()
        self._thread = threading.Thread(target=self._renew, name="liferaft-lease", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        info = LeaseInfo(**{**asdict(self.me), "renewed_unix": time.time()})
        self.storage.put_atomic(LEASE, json.dumps(asdict(info)).encode())

    def _ours(self, other: LeaseInfo | None) -> bool:
        return other is not None and other.token == self.me.token

    def _lost_to(self, other: LeaseInfo | None) -> str:
        who = "nobody (the lease was removed)" if other is None else \
            f"job {other.job_id!r} (host {other.host}, pid {other.pid})"
        return f"{self.storage.url}: this job lost its lease on the root to {who}; two jobs must not write the same root"

    def check(self) -> None:
        """Raise CheckpointBusyError if another job has taken the lease (or renewing it failed)."""
        if isinstance(self.error, CheckpointBusyError):
            raise self.error
        if self.error is not None:
            raise CheckpointBusyError(f"{self.storage.url}: renewing the lease failed: {self.error}")
        other = _read(self.storage)
        if not self._ours(other):
            raise CheckpointBusyError(self._lost_to(other))

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                other = _read(self.storage)
                if not self._ours(other):      # taken over: never write over another job's lease
                    self.error = CheckpointBusyError(self._lost_to(other))
                    return
                self._write()
            except OSError as e:        # surfaces at the next check() (before the next save)
                self.error = e

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                if self._ours(_read(self.storage)):
                    self.storage.delete(LEASE)
            except OSError:
                pass
