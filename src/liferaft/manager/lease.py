"""One writer per root: a lease object (``LEASE``) that the manager of a job holds while it may write there.

The holder (rank 0 of the job) rewrites the lease every ``ttl / 3`` seconds. A newcomer takes the lease when

- there is none, or it was not renewed for the holder's ``ttl`` seconds (stale), or
- its holder ran on this machine (same host, kernel and pid namespace) and that process is gone, or
- its holder ran on another machine and has the newcomer's job id (the same job restarting, its rank 0 now
  elsewhere: ``manager.identity`` says what a job id is), or
- its holder is this very process under the same job id (a manager re-created without ``close()``).

Otherwise it waits up to the holder's ``ttl`` (the holder may be closing) and then refuses with
CheckpointBusyError: a live process on this machine is never taken over, whatever its job id, so two launches
given the same ``job_id`` do not kill each other. This is detection, not a lock service: two jobs that start within
the same instant can both write the lease; each reads it back after writing and before every save, so the loser
finds out before its first commit.

A root that cannot be written (read-only file system, no write permission, PUT denied) raises ReadOnlyRootError
from ``acquire`` before any waiting: the manager then only restores.

The holder also records the start of each of its processes in ``STARTS`` (``record_start``): the restarts a root
has seen are the failure rate that ``every_seconds="auto"`` learns.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from liferaft.core.commit import guard_commits
from liferaft.errors import CheckpointBusyError, LiferaftError, ReadOnlyRootError, StorageError
from liferaft.format import jsonsafe
from liferaft.format.limits import MAX_INT, MAX_ROOT_FILE_BYTES, MAX_UNIX_TIME
from liferaft.manager.identity import machine_key, process_start
from liferaft.storage import PosixStorage, Storage

LEASE = "LEASE"
STARTS = "STARTS"              # start times of the jobs' processes on this root (every_seconds="auto" learns from it)
#: The longest a newcomer waits for a lease held by another job (the holder's recorded ttl is taken up to this,
#: or up to the newcomer's own ttl if that is longer).
MAX_WAIT_S = 300.0
_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass(frozen=True)
class LeaseInfo:
    job_id: str
    host: str
    pid: int
    renewed_unix: float
    token: str = ""         # one per Lease object: tells two managers of one process apart
    started: int | None = None      # the holder's process start time (tells a reused pid apart)
    machine: str = ""       # boot id and pid namespace of the holder (pids compare only within one)
    ttl: float | None = None        # the holder's ttl: stale after that long without renewal


_MAX_PID = 2 ** 31 - 1      # a pid_t: no process of any system has a larger one (a lease naming one is damaged)


def _read(storage: Storage) -> LeaseInfo | None:
    """The lease under the root, or None when there is none or it is damaged (not strict JSON, a field missing or
    out of range): a damaged lease protects nothing, so it is treated as absent and overwritten by ``acquire``."""
    try:
        raw = jsonsafe.loads(storage.read_all(LEASE, MAX_ROOT_FILE_BYTES), f"{storage.url}/{LEASE}",
                            MAX_ROOT_FILE_BYTES)
        if not isinstance(raw, dict):
            return None
        started, ttl, pid = raw.get("started"), raw.get("ttl"), raw["pid"]
        if type(pid) is not int or not 0 <= pid <= _MAX_PID or started is not None and (
                type(started) is not int or not 0 <= started <= MAX_INT):
            return None
        return LeaseInfo(job_id=str(raw["job_id"]), host=str(raw["host"]), pid=pid,
                         renewed_unix=_finite(raw["renewed_unix"]), token=str(raw.get("token", "")),
                         started=started, machine=str(raw.get("machine", "")),
                         ttl=float(ttl) if _number(ttl) and ttl > 0 else None)
    except FileNotFoundError:
        return None
    except (LiferaftError, ValueError, KeyError, TypeError, AttributeError):
        return None        # a damaged lease protects nothing: treat as absent


def _number(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)       # type: ignore[arg-type]


def _finite(x: object) -> float:
    """A finite number, else ValueError."""
    if not _number(x):
        raise ValueError(f"not a finite number: {x!r:.40}")
    return float(x)                                            # type: ignore[arg-type]


def _time(x: object) -> float:
    """A recorded time (seconds since 1970): a finite number in ``[0, MAX_UNIX_TIME]``, else ValueError."""
    if not _number(x) or not 0 <= x <= MAX_UNIX_TIME:         # type: ignore[operator]
        raise ValueError(f"not a time: {x!r:.40}")
    return float(x)                                            # type: ignore[arg-type]


def _pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` (started at ``started``, where known) runs on this machine."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False                            # (no such process; a pid no system has)
    except PermissionError:
        pass                                    # another user's process: alive
    if started is not None:
        now = process_start(pid)
        if now is not None and now != started:
            return False                        # the pid was reused by a later process
    return True


def _denied(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says that the storage refuses writes."""
    denied_types: tuple[type, ...] = ()
    obstore_errors = sys.modules.get("obstore.exceptions")       # (loaded where an S3 storage is in use)
    if obstore_errors is not None:
        denied_types = (obstore_errors.PermissionDeniedError,)
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _DENIED or isinstance(seen, denied_types):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_only_reason(storage: Storage) -> str | None:
    """Why ``storage`` (a manager root) cannot be written, as far as can be told without writing (a local root:
    read-only file system, no write permission on the root or, where it does not exist yet, the folder it
    would be made in); None if it looks writable or this cannot be told. Raises StorageError when the root
    (or a folder above it) is not a directory."""
    if not isinstance(storage, PosixStorage):
        return None
    path = storage.root
    while not os.path.exists(path):
        up = os.path.dirname(path)
        if up == path:
            return None
        path = up
    if not os.path.isdir(path):
        what = "the root" if path == storage.root else f"{path}, a folder above the root,"
        raise StorageError(f"{storage.root}: {what} is not a directory (a regular file?); a CheckpointManager "
                           "root must be a directory or a path that does not exist yet: pass another root")
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only file system"
    except OSError:
        pass
    if not os.access(path, os.W_OK | os.X_OK):
        return f"this process may not write in {path}"
    return None


class Lease:
    """The lease of ``job_id`` on ``storage`` (acquire → renew in a thread → release)."""

    def __init__(self, storage: Storage, job_id: str, ttl: float = 30.0, max_wait: float = MAX_WAIT_S) -> None:
        self.storage = storage
        self.max_wait = max_wait
        self.me = LeaseInfo(job_id=job_id, host=socket.gethostname(), pid=os.getpid(), renewed_unix=0.0,
                            token=uuid.uuid4().hex, started=process_start(os.getpid()), machine=machine_key(),
                            ttl=ttl)
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._written: float | None = None      # monotonic time the last write of this lease began (``_lapsed``)

    # ------------------------------------------------------------------ who holds it

    def _same_machine(self, other: LeaseInfo) -> bool:
        """Whether ``other``'s pid can be checked here."""
        if other.host != self.me.host:
            return False
        return not (other.machine and self.me.machine) or other.machine == self.me.machine

    def _ttl_of(self, other: LeaseInfo) -> float:
        """The holder's ttl as recorded (else ours): its lease is stale after that long without renewal."""
        return other.ttl if other.ttl is not None else self.ttl

    def _wait_of(self, other: LeaseInfo) -> float:
        """How long to wait for ``other``: its ttl, bounded by ``MAX_WAIT_S`` or our own ttl if longer (a lease
        file is input too: a crafted ttl must not make a newcomer wait forever; past the bound it is refused, not
        taken over)."""
        return min(self._ttl_of(other), max(self.ttl, self.max_wait))

    def _busy_reason(self, other: LeaseInfo) -> str | None:
        """None if this lease may be taken over from ``other``; else why not."""
        if other.token == self.me.token:
            return None
        if time.time() - other.renewed_unix > self._ttl_of(other):
            return None                                             # stale: its holder stopped renewing
        if self._same_machine(other):
            if not _pid_alive(other.pid, other.started):
                return None                                         # its holder died (a crash, a restart)
            if other.pid == self.me.pid and other.started == self.me.started and other.job_id == self.me.job_id:
                return None                                         # this process, same job: re-created
            if other.job_id == self.me.job_id:
                return (f"another live process of job {other.job_id!r} on this host (pid {other.pid}) holds it: two "
                        "launches with the same job_id must not write one root at once. Stop that process, or give "
                        "this launch another job_id or another root")
            return (f"job {other.job_id!r} holds it (host {other.host}, pid {other.pid}, alive); two jobs must not "
                    "write the same root. Stop the other job, or use another root")
        if other.job_id == self.me.job_id:
            return None                                             # the same job restarting, rank 0 moved
        return (f"job {other.job_id!r} holds it (host {other.host}, pid {other.pid}, renewed "
                f"{max(0.0, time.time() - other.renewed_unix):.0f} s ago); two jobs must not write the same root. "
                f"Stop the other job, or use another root (a lease not renewed for {self._ttl_of(other):g} s is "
                "free; a restart of the same job, with the same job id, takes it at once)")

    def _doubt(self, other: LeaseInfo, since: float, now: float) -> str:
        """What to add to a refusal when the lease looks abandoned rather than held (it is refused all the same:
        its holder may renew it less often than we waited)."""
        ahead = other.renewed_unix - time.time()
        if ahead > self._ttl_of(other):
            return (f". Its renewal time lies {ahead:.0f} s in the future (a clock that far off, or a damaged or "
                    f"crafted lease): if no job writes this root, delete {self.storage.url}/{LEASE}")
        if now - since >= self._wait_of(other) and other.ttl is not None and other.ttl > self._wait_of(other):
            return (f". It did not change in the {now - since:.0f} s we watched, but its holder's ttl is "
                    f"{other.ttl:g} s: if no job writes this root, delete {self.storage.url}/{LEASE}")
        return ""

    # ------------------------------------------------------------------ acquire, check, renew, release

    def acquire(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lease, waiting up to the holder's ttl for another job's lease to be released or go stale;
        raise CheckpointBusyError if it is still held then, ReadOnlyRootError if the root cannot be written.
        ``on_wait(message)`` is called once when the wait begins (a command line says why it seems to hang)."""
        why = read_only_reason(self.storage)
        if why is not None:
            raise self._read_only(why)
        deadline: float | None = None
        probed = False
        seen: tuple[LeaseInfo, float] | None = None     # the lease as first read unchanged, and since when
        while True:
            other = _read(self.storage)
            busy = None if other is None else self._busy_reason(other)
            if busy is None:
                break
            assert other is not None
            now = time.monotonic()
            if seen is None or seen[0] != other:
                seen = (other, now)                     # (re)written since: its holder renews it
            elif now - seen[1] > self._ttl_of(other):
                break       # not renewed for its ttl while we watched: stale, whatever its clock says
            if not probed:              # a reader on a root it may not write must not wait for the writer
                self._probe_write()
                probed = True
            if deadline is None:
                deadline = now + self._wait_of(other) + 1.0
                if on_wait is not None:
                    on_wait(f"{self.storage.url} is in use: {busy}; waiting up to {self._wait_of(other):.0f} s for "
                            "its lease to be released or to go stale")
            if now > deadline:
                raise CheckpointBusyError(f"{self.storage.url} is in use: {busy}" + self._doubt(other, seen[1], now))
            time.sleep(min(1.0, self._wait_of(other) / 10))
        try:
            self._write()
        except Exception as e:
            if _denied(e):
                raise self._read_only(str(e)) from e
            raise
        self.check()
        self._thread = threading.Thread(target=self._renew, name="liferaft-lease", daemon=True)
        self._thread.start()

    def _read_only(self, why: str) -> ReadOnlyRootError:
        return ReadOnlyRootError(f"{self.storage.url} is read-only ({why}): a CheckpointManager there can restore "
                                 "and list steps but not save; save under a writable root")

    def _probe_write(self) -> None:
        """Raise ReadOnlyRootError if the root refuses a write (a probe object, removed again)."""
        name = f"{LEASE}.probe-{self.me.token}"
        try:
            self.storage.put_atomic(name, b"")
        except Exception as e:
            if _denied(e):
                raise self._read_only(str(e)) from e
            raise
        try:
            self.storage.delete(name)
        except OSError:
            pass

    def _write(self) -> None:
        began = time.monotonic()
        info = LeaseInfo(**{**asdict(self.me), "renewed_unix": time.time()})
        self.storage.put_atomic(LEASE, json.dumps(asdict(info)).encode())
        self._written = began

    def _lapsed(self, since: float | None = None) -> str | None:
        """Why this holder must take its lease as lost although the file still names it: its last write (or
        ``since``) began a ttl or more ago (the process was stopped or starved that long), so a newcomer may have
        found it stale and be taking the root over right now; a write or commit it made now could land over the
        newcomer's. None while renewed in time. (A holder fences itself: no lease store here offers a
        compare-and-swap.)"""
        since = self._written if since is None else since
        if since is None:
            return None
        idle = time.monotonic() - since
        if idle < self.ttl:
            return None
        return (f"{self.storage.url}: this job's lease was not renewed for {idle:.0f} s, its ttl is {self.ttl:g} s "
                "(the process was stopped or starved that long): another job may be taking the root over, so this "
                "job no longer writes there; restart it to take the lease again (a job whose own steps stall it "
                "that long needs a longer JobOptions(lease_ttl=...))")

    def _ours(self, other: LeaseInfo | None) -> bool:
        return other is not None and other.token == self.me.token

    def _lost_to(self, other: LeaseInfo | None) -> str:
        who = "nobody (the lease was removed)" if other is None else \
            f"job {other.job_id!r} (host {other.host}, pid {other.pid})"
        return (f"{self.storage.url}: this job lost its lease on the root to {who}; two jobs must not write the "
                "same root")

    def check(self) -> None:
        """Raise CheckpointBusyError if another job has taken the lease (or renewing it failed)."""
        if isinstance(self.error, CheckpointBusyError):
            raise self.error
        if self.error is not None:
            raise CheckpointBusyError(f"{self.storage.url}: renewing the lease failed: {self.error}")
        other = _read(self.storage)
        if not self._ours(other):
            raise CheckpointBusyError(self._lost_to(other))
        lapsed = self._lapsed()
        if lapsed is not None:
            raise CheckpointBusyError(lapsed)

    def guard(self) -> Callable[[], None]:
        """Have every commit and step deletion under the root in this process check this lease first
        (``core.commit.guard_commits``) until the returned function is called."""
        return guard_commits(self.storage.url, self.check)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                other = _read(self.storage)
                if not self._ours(other):      # taken over: never write over another job's lease
                    self.error = CheckpointBusyError(self._lost_to(other))
                    return
                before = self._written
                lapsed = self._lapsed()
                if lapsed is None:
                    self._write()
                    # (a write that ended a ttl after the last began: stopped after the check, it may have replaced
                    # a newcomer's lease; this job stops writing, and the newcomer, finding this job's, stops too)
                    lapsed = self._lapsed(before)
                if lapsed is not None:
                    self.error = CheckpointBusyError(lapsed)
                    return
                self.error = None       # (renewed: a failed renewal before it, a passing EIO, is over)
            except OSError as e:        # surfaces at the next check() (before the next save and its commit)
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


def record_start(storage: Storage) -> list[float]:
    """Rank 0, holding the lease: append this start to ``STARTS`` under the root (the last 100; an unreadable
    record starts over); return them all."""
    try:
        doc = jsonsafe.loads(storage.read_all(STARTS, MAX_ROOT_FILE_BYTES), f"{storage.url}/{STARTS}",
                            MAX_ROOT_FILE_BYTES)
        starts = [_time(x) for x in doc][-99:] if isinstance(doc, list) else []
    except (FileNotFoundError, LiferaftError, ValueError, TypeError):
        starts = []
    starts.append(time.time())
    storage.put_atomic(STARTS, json.dumps(starts).encode())
    return starts
