"""The local I/O path, chosen per device at run time: O_DIRECT or the page cache, and how many requests in flight.

Which path is fastest depends on the device and on its hour: on these VMs O_DIRECT writes run at 2 GB/s on a
fast hour and below a buffered write (the kernel's writeback queues deep, merged requests) on a slow one. So
``PosixStorage`` asks, on its first large request (``PROBE_FROM`` bytes or more: small checkpoints and tests
never pay for it), for the ``Choice`` of its device: ``probe`` writes (with fsync) a short file, and reads
(cold: O_DIRECT, or buffered after ``POSIX_FADV_DONTNEED``) a longer one, timed past the read-ahead's ramp
(``steady_rate``), on the storage's file system on every path — O_DIRECT and buffered, 1 and ``MANY`` requests
in flight — and ``choose``, a pure function of those figures, keeps among
the paths within ``MARGIN`` of the fastest O_DIRECT first, for writes and reads alike; a page-cache path only
where it beats every O_DIRECT path by ``CACHE_MARGIN`` (``choose`` says why). The choice is kept per device
(``st_dev``) for the life of the process; ``forget`` drops it.

Side effects: the probe's file is unnamed (``O_TMPFILE``) where the file system allows, so a kill -9 during the
probe leaves nothing; elsewhere it is ``PROBE_PREFIX``... in the folder, which no reader takes for data and
cleanup removes (``is_probe_name``). A read of an existing checkpoint never writes: before the first large
write of a device, reads measure only the read paths, on the data file being read (``probe_reads``). The
processes of one host probing the same folder take turns (``flock`` of the folder), and share what the first
measured: its figures go to a small file in ``HOST_DIR`` (``liferaft-iopath-<uid>-<device>-<kind>.json``, this
user's, written whole or not at all), which the others take instead of probing while it is at most ``HOST_TTL``
seconds old; anything there that is not such a file of this user, fresh and well formed, is ignored (they probe).
So the ranks of a host pay one probe (~0.5 s here) at a job's first large save or load, not one each in turn.
A file system that refuses O_DIRECT (tmpfs before Linux 6.6) has no O_DIRECT figures, so the choice is buffered.

Data already in the page cache (a file just written through it, or read before) is read through it whatever the
device's choice: O_DIRECT would fetch from the device bytes that memory holds (a load right after a buffered
save, or a second load, ran at disk speed instead of memory speed). The rule, per read request of the O_DIRECT
path: ``resident_share`` (``mincore`` on a private mapping of the request's range: nothing is read or faulted
in, tens of microseconds) tells the share ``r`` of its pages in the cache, and the request reads through the
cache when ``cache_read_wins(r, Choice.cache_floor)``: ``r`` at least ``cache_floor = max(MIN_RESIDENT,
1 - b/d)``, where b and d are the probe's best cold buffered and O_DIRECT read rates (cached pages taken as
free: through the cache the request costs (1 - r)/b, by O_DIRECT 1/d). Cold data keeps the probed path. A
load by O_DIRECT leaves nothing in the page cache: a second load of the same checkpoint reads the device again
(at its rate, not memory's), and ranks of one host that each read the same bytes for themselves (replicated
tensors with ``LoadOptions(share_reads=False)``, or no shared-memory folder: ``core.load``) each read them from
the device. Where that is the common case (a checkpoint loaded again and again, many readers of one file),
``PosixStorage(path, direct_io=False)`` forces the page cache.

``Choice`` is also what a caller forces: ``PosixStorage(root, direct_io=False, inflight=4)`` never probes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import math
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from liferaft.format.layout import PROBE_PREFIX, is_probe_name  # noqa: F401 - is_probe_name: for callers
from liferaft.storage.iobuf import huge_buffer

PAGE = 4096
MIN_RESIDENT = 0.5          # the least share of a request's pages in the page cache for it to read through it
PROBE_FROM = 8 << 20         # a request at least this large asks for the device's choice (probing it once)
PROBE_BYTES = 16 << 20       # written on every path, in every round, by the probe
PROBE_REQUEST = 4 << 20      # request size of the probe
READ_BYTES = 48 << 20        # read on every path, in every round, by the probe (a file of this size)
READ_RAMP = 16 << 20         # a probe read is timed past its first this many bytes (the steady state; see ``_read``)
MANY = 4                     # "several requests in flight" of the probe and the most ``choose`` picks
SPLIT_MIN = 1 << 20          # a request is split across threads in parts of at least this many bytes
MARGIN = 1.15                # paths this close to the fastest count as equal (O_DIRECT first)
CACHE_MARGIN = 1.5           # a page-cache path must beat every O_DIRECT path by this much in the probe
ROUNDS = 2                   # the probe times every path this many times, interleaved, and keeps its best
HOST_DIR = "/dev/shm"        # where the processes of a host share their probes (a seam: tests point it elsewhere)
HOST_TTL = 600.0             # seconds a shared probe is taken by the host's other processes (the disk's hour moves)
_HOST_MAX = 4096             # bytes: a larger shared-probe file is not one of ours

Path = tuple[bool, int]      # (O_DIRECT, requests in flight)


@dataclass(frozen=True)
class Choice:
    """The path of one device: O_DIRECT or buffered, and requests in flight, for writes and for reads."""

    write_direct: bool = True
    write_inflight: int = 1
    read_direct: bool = True
    read_inflight: int = 1
    cache_floor: float = MIN_RESIDENT   # a read request this much in the page cache reads through it


@dataclass(frozen=True)
class Probe:
    """Measured bytes per second of each path (``(direct, inflight)``; O_DIRECT paths absent where refused);
    ``shared``: measured by another process of this host (``HOST_DIR``), ``seconds`` then 0."""

    write: Mapping[Path, float]
    read: Mapping[Path, float]
    seconds: float = 0.0
    shared: bool = False


def encode_probe(p: Probe) -> bytes:
    """The figures of ``p`` as the bytes of a shared-probe file (``decode_probe`` reads them back)."""
    return json.dumps({"v": 1, **{side: [[d, k, r] for (d, k), r in sorted(getattr(p, side).items())]
                                  for side in ("write", "read")}}).encode()


def decode_probe(data: bytes) -> Probe | None:
    """The ``Probe`` (``shared``) in a shared-probe file's bytes, or None for anything else (pure; the file is
    in a folder every user can write to, so nothing in it is trusted): at most ``_HOST_MAX`` bytes of JSON, per
    side at most one row per path, each (bool, 1 or ``MANY``, a finite positive rate)."""
    if len(data) > _HOST_MAX:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("v") != 1:
        return None
    sides: dict[str, dict[Path, float]] = {}
    for side in ("write", "read"):
        rows = obj.get(side)
        if not isinstance(rows, list) or len(rows) > 4:
            return None
        got: dict[Path, float] = {}
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and type(row[0]) is bool and type(row[1]) is int
                    and row[1] in (1, MANY) and type(row[2]) in (int, float) and math.isfinite(row[2])
                    and row[2] > 0) or (row[0], row[1]) in got:
                return None
            got[(row[0], row[1])] = float(row[2])
        sides[side] = got
    return Probe(write=sides["write"], read=sides["read"], shared=True)


def _host_file(dev: int, kind: str) -> str:
    return os.path.join(HOST_DIR, f"liferaft-iopath-{os.getuid()}-{dev}-{kind}.json")


def _load_shared(dev: int, kind: str) -> Probe | None:
    """The probe of device ``dev`` (``kind``: "full" or "reads") another process of this host shared, if it is a
    regular file of this user (not followed through a link; a FIFO put there is opened without waiting for a
    writer, then refused), at most ``HOST_TTL`` seconds old and well formed."""
    try:
        fd = os.open(_host_file(dev, kind), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        age = time.time() - st.st_mtime
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _HOST_MAX \
                or not -5.0 <= age <= HOST_TTL:
            return None
        return decode_probe(os.read(fd, _HOST_MAX + 1))
    except OSError:
        return None
    finally:
        os.close(fd)


def _store_shared(dev: int, kind: str, p: Probe) -> None:
    """Share ``p`` with the host's other processes: written to a new file of this user, then renamed over the
    device's name (a reader sees all of it or the one before); nothing when that cannot be done."""
    tmp = os.path.join(HOST_DIR, f"liferaft-iopath-{os.getuid()}-{dev}-{kind}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return
    try:
        try:
            os.write(fd, encode_probe(p))
        finally:
            os.close(fd)
        os.replace(tmp, _host_file(dev, kind))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _pick(rates: Mapping[Path, float]) -> Path:
    """Among the paths within ``MARGIN`` of the fastest (a short probe is noisy): O_DIRECT before the page cache
    (no copy through it, no CPU paid for it), then the fewest requests in flight."""
    if not rates:
        return (False, 1)
    best = max(rates.values())
    return min((p for p, r in rates.items() if r * MARGIN >= best), key=lambda p: (not p[0], p[1]))


def _direct_unless_cache_wins(rates: Mapping[Path, float], by: float) -> Mapping[Path, float]:
    """``rates`` without its page-cache paths unless one beats every O_DIRECT path by ``by``."""
    direct = [r for (d, _), r in rates.items() if d]
    cached = [r for (d, _), r in rates.items() if not d]
    if direct and cached and max(cached) < by * max(direct):
        return {p: r for p, r in rates.items() if p[0]}
    return rates


def choose(probe: Probe) -> Choice:
    """The ``Choice`` for the figures of ``probe`` (pure: the same figures, the same choice). A page-cache path,
    for writes and for reads alike, must beat every O_DIRECT path by ``CACHE_MARGIN`` in the probe: a short
    probe flatters it. Its few MiB go through page-cache pages the kernel has just freed and hands back warm,
    while a save or load of GBs first touches one fresh page-cache page per byte (~1 GB/s on these VMs while
    their memory is fresh) and copies every byte once more; O_DIRECT does neither (it moves the bytes between the
    device and liferaft's own buffers, already touched), so its CPU cost stays low and it evicts nothing of the
    job's page cache. Measured on this VM on 2026-12-06 (fresh VM, 15:45 UTC): the probe read 2.71 GB/s through
    the cache and 2.03 by O_DIRECT (1.33x), while 2-rank loads of 512 MiB ran 0.26 s by O_DIRECT (0.28 CPU s/GB)
    against 0.37 s through the cache (0.72), and a 1-process load of 0.54 GB 0.28-0.30 s against 0.55-1.22 s
    (0.33 against 1.0-1.9 CPU s/GB). Which path wins whole loads moves with the VM's hour more than a 48 MiB
    probe sees: half an hour later both ran 0.30-0.32 s in one process, and a review timed the cache 1.3x faster
    once (0.40 against 0.50-0.56 s, other loads running); on 2026-12-05 the probe's cache was 2x O_DIRECT's rate
    and whole loads through it 1.2x faster (taken here: 2x is past the margin). The read figures are
    steady-state rates (``steady_rate``). Among the paths left, ``_pick``."""
    wd, wk = _pick(_direct_unless_cache_wins(probe.write, CACHE_MARGIN))
    rd, rk = _pick(_direct_unless_cache_wins(probe.read, CACHE_MARGIN))
    return Choice(write_direct=wd, write_inflight=wk, read_direct=rd, read_inflight=rk,
                  cache_floor=cache_floor(probe.read))


def cache_floor(read: Mapping[Path, float]) -> float:
    """The least share of a request's pages in the page cache from which reading it through the cache beats
    O_DIRECT, for the cold read rates ``read`` (pure): through the cache a request costs (1 - r)/b (cached pages
    at memory speed, taken as free; the others at the best buffered cold rate b), by O_DIRECT 1/d (the best
    O_DIRECT rate d): ``max(MIN_RESIDENT, 1 - b/d)``; ``MIN_RESIDENT`` without both figures."""
    direct = [r for (d, _), r in read.items() if d and r > 0]
    cached = [r for (d, _), r in read.items() if not d and r > 0]
    if not direct or not cached:
        return MIN_RESIDENT
    return min(1.0, max(MIN_RESIDENT, 1.0 - max(cached) / max(direct)))


def cache_read_wins(resident: float | None, floor: float) -> bool:
    """Whether a read request whose pages are ``resident`` (share in the page cache, ``resident_share``; None:
    unknown) in the page cache reads through it rather than by O_DIRECT (pure): at least ``floor`` of them, and
    some."""
    return resident is not None and resident > 0 and resident >= floor


_MINCORE: Any = None
_LOW_BIT = bytes(b & 1 for b in range(256))


def _mincore() -> Any:
    global _MINCORE
    if _MINCORE is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _MINCORE = fn
        except (OSError, AttributeError):
            _MINCORE = False
    return _MINCORE


def resident_share(fd: int, offset: int, length: int) -> float | None:
    """The share of the pages of bytes ``[offset, offset + length)`` of the file ``fd`` (open for reading) that
    are in the page cache, by ``mincore`` on a private mapping of that range (no byte is read, no page faulted
    in, nothing written); 0.0 for a range past the end of the file; None where it cannot be told (no
    ``mincore``, a file that cannot be mapped)."""
    fn = _mincore()
    if not fn or length <= 0:
        return None
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        size = os.fstat(fd).st_size
        end = min(offset + length, size)
        if end <= start:
            return 0.0
        m = mmap.mmap(fd, end - start, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError):
        return None
    pages = -(-(end - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    try:
        ref = ctypes.c_char.from_buffer(m)
        try:
            rc = fn(ctypes.addressof(ref), end - start, vec)
        finally:
            del ref
    finally:
        m.close()
    if rc != 0:
        return None
    return bytes(vec).translate(_LOW_BIT).count(1) / pages      # (bit 0: resident; the rest reserved)


def spans(offset: int, length: int, inflight: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` cut into at most ``inflight`` (position, length) parts on page boundaries
    (relative to ``offset``), each at least ``SPLIT_MIN`` bytes but the last."""
    parts = max(1, min(inflight, length // SPLIT_MIN))
    step = -(-length // parts // PAGE) * PAGE if parts > 1 else length
    return [(offset + at, min(step, length - at)) for at in range(0, length, step)] if length else [(offset, 0)]


def in_parallel(fn: Callable[[int, int], int], parts: list[tuple[int, int]]) -> list[int]:
    """``fn(position, length)`` for every part, the first in this thread and the others in threads of their own;
    returns their results in order, or raises the first part's error once all have ended."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    out: list[int] = [0] * len(parts)
    errors: list[BaseException | None] = [None] * len(parts)

    def run(i: int) -> None:
        try:
            out[i] = fn(*parts[i])
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name="liferaft-io", daemon=True) for i in range(1, len(parts))]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return out


def _write(fd: int, buf: memoryview, inflight: int) -> None:
    def one(pos: int, n: int) -> int:
        with memoryview(buf)[pos:pos + n] as view:     # (released on a failure too: ``_close_probe``)
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], pos + done)
            return done

    requests = [(at, min(PROBE_REQUEST, PROBE_BYTES - at)) for at in range(0, PROBE_BYTES, PROBE_REQUEST)]
    for i in range(0, len(requests), inflight):
        in_parallel(one, requests[i:i + inflight])
    os.fsync(fd)


def _read(fd: int, buf: memoryview, inflight: int, nbytes: int) -> float:
    """Read the first ``nbytes`` of ``fd`` in ``PROBE_REQUEST`` requests, ``inflight`` at a time, into ``buf``
    (reused: request ``at`` lands at ``at % len(buf)``); return ``steady_rate`` of the reads."""
    def one(pos: int, n: int) -> int:
        at = pos % len(buf)
        with memoryview(buf)[at:at + n] as view:
            return os.preadv(fd, [view], pos)

    requests = [(at, min(PROBE_REQUEST, nbytes - at)) for at in range(0, nbytes, PROBE_REQUEST)]
    marks = [(0, time.perf_counter())]
    for i in range(0, len(requests), inflight):
        group = requests[i:i + inflight]
        in_parallel(one, group)
        marks.append((group[-1][0] + group[-1][1], time.perf_counter()))
    return steady_rate(marks)


def steady_rate(marks: list[tuple[int, float]]) -> float:
    """Bytes per second of a read from ``marks``, (bytes read so far, time) at its start and after each group of
    requests (pure): past the first ``READ_RAMP`` bytes when at least as many follow, else of the whole read. A
    cold buffered read starts slow and speeds up as the kernel's read-ahead window grows (on these VMs its first
    16 MiB ran 0.9x an O_DIRECT read, its next 32 MiB 1.4x, a whole 256 MiB file 1.6-1.9x), and a load reads
    GBs: the first MiBs alone ranked the paths the wrong way round."""
    total, end = marks[-1]
    start = next(((n, t) for n, t in marks if n >= READ_RAMP and total - n >= READ_RAMP), marks[0])
    return (total - start[0]) / max(end - start[1], 1e-9)


def _probe_file(folder: str) -> tuple[int, str | None]:
    """A new, empty file on ``folder``'s file system open for reading and writing: unnamed (``O_TMPFILE``:
    nothing to see, nothing left by a kill -9) where the file system allows it, else created exclusively as
    ``PROBE_PREFIX``... (never through a link); returns (descriptor, name or None)."""
    base = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(folder, base | os.O_TMPFILE, 0o600), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    name = os.path.join(folder, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    return os.open(name, base | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600), name


def _set_direct(fd: int, direct: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False where the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if direct else (flags & ~os.O_DIRECT))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def _paths() -> list[Path]:
    return [(d, k) for d in ((True, False) if hasattr(os, "O_DIRECT") else (False,)) for k in (1, MANY)]


def _rounds(measure: Callable[[bool, int], tuple[float, float] | None]) -> tuple[dict[Path, float], dict[Path, float]]:
    """``measure(direct, k)`` (write, read) for every path, ``ROUNDS`` times in alternating order, each path's
    best kept; a path ``measure`` refuses (None) in the first round is left out."""
    write: dict[Path, float] = {}
    read: dict[Path, float] = {}
    paths = _paths()
    for r in range(ROUNDS):
        for direct, k in (paths if r % 2 == 0 else paths[::-1]):
            if r and (direct, k) not in read:
                continue                             # refused in the first round
            got = measure(direct, k)
            if got is not None:
                write[(direct, k)] = max(write.get((direct, k), 0.0), got[0])
                read[(direct, k)] = max(read.get((direct, k), 0.0), got[1])
    return write, read


def probe(folder: str) -> Probe:
    """Time every path on one ``PROBE_BYTES`` file on ``folder``'s file system, ``ROUNDS`` times in alternating
    order, keeping each path's best (what the device can do, not what a neighbour's burst left of it); O_DIRECT
    paths the file system refuses are left out. The file has no name where the file system allows (``O_TMPFILE``),
    else it is ``PROBE_PREFIX``... in ``folder`` (``is_probe_name``), removed after."""
    t0 = time.perf_counter()
    fd, name = _probe_file(folder)
    buf = huge_buffer(PROBE_BYTES)                     # (the memory a load's or a save's requests come from)
    buf[:] = b"\x5a" * PROBE_BYTES                      # prefaulted
    try:
        write, _ = _rounds(lambda direct, k: _time_write(fd, buf, direct, k))
        filled = _fill(fd, buf, READ_BYTES)
        _, read = _rounds(lambda direct, k: _time_read(fd, buf, direct, k, filled)) if filled else ({}, {})
    finally:
        _close_probe(fd, name, buf)
    return Probe(write=write, read=read, seconds=time.perf_counter() - t0)


def _close_probe(fd: int, name: str | None, buf: memoryview) -> None:
    """Close (and remove) the probe file first, whatever failed, so that neither its name nor the space it holds
    outlives the probe; then this view of the buffer (its memory goes with the last view: a failed request's
    traceback may still hold one)."""
    try:
        os.close(fd)
    finally:
        try:
            if name is not None and os.path.lexists(name):
                os.unlink(name)
        finally:
            buf.release()


def _time_write(fd: int, buf: memoryview, direct: bool, k: int) -> tuple[float, float] | None:
    """(write + fsync bytes per second of one path on the probe file ``fd``, 0); None where the file system
    refuses O_DIRECT."""
    os.ftruncate(fd, 0)
    if not _set_direct(fd, direct):
        return None
    try:
        t = time.perf_counter()
        _write(fd, buf, k)
        return PROBE_BYTES / max(time.perf_counter() - t, 1e-9), 0.0
    except OSError as e:
        if e.errno != errno.EINVAL or not direct:
            raise
        return None


def _fill(fd: int, buf: memoryview, nbytes: int) -> int:
    """Make the probe file ``fd`` up to ``nbytes`` long (copies of ``buf``, through the page cache), on the device;
    return its length: shorter, in whole pages, where the file system has no room for all of it (the reads are
    then timed on what fits; 0: no read figures)."""
    _set_direct(fd, False)
    os.ftruncate(fd, 0)
    at = 0
    with memoryview(buf) as view:
        try:
            while at < nbytes:
                at += os.pwrite(fd, view[:min(len(buf), nbytes - at)], at)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            at = at // PAGE * PAGE
            os.ftruncate(fd, at)
    os.fsync(fd)
    return at


def _time_read(fd: int, buf: memoryview, direct: bool, k: int, nbytes: int) -> tuple[float, float] | None:
    """(0, cold read bytes per second of one path: ``_read`` of the first ``nbytes`` of ``fd`` after dropping
    them from the page cache); None where the file system refuses O_DIRECT."""
    if not _set_direct(fd, direct):
        return None
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        return 0.0, _read(fd, buf, k, nbytes)
    except OSError as e:
        if e.errno != errno.EINVAL or not direct:
            raise
        return None


def probe_reads(open_file: Callable[[bool], int], size: int) -> Probe | None:
    """Time the cold read of the first ``min(size, READ_BYTES)`` bytes (whole pages) of an existing file on
    every read path, as ``probe`` does, writing nothing: ``open_file(direct)`` opens it (O_DIRECT or not; OSError
    EINVAL where refused). For reads of a checkpoint that must not be written to (read, convert, inspect).
    None, measuring nothing, when those bytes are in the page cache (``cache_read_wins`` at ``MIN_RESIDENT``):
    a cold read needs them dropped from it first, and the caller is about to read them from there."""
    t0 = time.perf_counter()
    n = min(size, READ_BYTES) // PAGE * PAGE
    if n:
        fd = open_file(False)
        try:
            if cache_read_wins(resident_share(fd, 0, n), MIN_RESIDENT):
                return None
        finally:
            os.close(fd)
    buf = huge_buffer(max(min(n, PROBE_BYTES), PAGE))
    buf[:] = b"\0" * len(buf)

    def measure(direct: bool, k: int) -> tuple[float, float] | None:
        try:
            fd = open_file(direct)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return 0.0, _read(fd, buf, k, n)
        finally:
            os.close(fd)

    try:
        _, read = _rounds(measure) if n else ({}, {})
    finally:
        buf.release()           # (the memory goes with the last view: a failed request's traceback may hold one)
    return Probe(write={}, read=read, seconds=time.perf_counter() - t0)


_CHOICES: dict[int, tuple[Choice, Probe]] = {}
_READS: dict[int, tuple[Choice, Probe]] = {}     # devices probed for reads only (no write was allowed there)
_LOCK = threading.Lock()


@contextlib.contextmanager
def _host_lock(dev: int) -> Iterator[None]:
    """An exclusive ``flock`` of this user's lock file of device ``dev`` in ``HOST_DIR`` while a probe runs, so that
    the processes of one host probing the same device (the ranks of a job) take turns instead of skewing each
    other's figures; where it cannot be made or locked, nothing is held. (Not the probed folder itself: a save
    holds its folder's ``flock`` for its whole run, ``PosixStorage.lock_writer``.)"""
    try:
        fd = os.open(os.path.join(HOST_DIR, f"liferaft-iopath-{os.getuid()}-{dev}.lock"),
                     os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0), 0o600)
    except OSError:
        yield
        return
    try:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)                            # (closing the descriptor releases the lock)


def choice_for(folder: str, reading: Callable[[], tuple[Callable[[bool], int], int]] | None = None) -> Choice:
    """The ``Choice`` of ``folder``'s device, kept per device for the life of the process once measured.

    Without ``reading``: probed in ``folder`` (``probe``: an unnamed file where the file system allows) on the
    first call for that device. With ``reading`` (called only to probe; it returns (``open_file``, size) of an
    existing file to be read, or raises, and then nothing is kept) and no full probe of the device yet: only its
    read paths are measured (``probe_reads``), on that file, and nothing is written; a file in the page cache is
    not measured (nor dropped from it): the default ``Choice()`` this time, nothing kept. The probes of one
    folder by the processes of a host take turns (``flock`` of the folder), and a process takes the figures
    another one shared (``HOST_DIR``, at most ``HOST_TTL`` s old: a full probe, or for a read a read-only one)
    instead of probing. A device that cannot be probed keeps the default ``Choice()``: O_DIRECT, one request in
    flight."""
    dev = os.stat(folder).st_dev
    with _LOCK:
        known = _CHOICES.get(dev) or (_READS.get(dev) if reading is not None else None)
        if known is None:
            kept = _CHOICES if reading is None else _READS
            target = None if reading is None else reading()
            try:
                with _host_lock(dev):
                    p = _load_shared(dev, "full")           # (taken by a read too: it has the read figures)
                    if p is not None:
                        kept = _CHOICES
                    elif target is not None:
                        p = _load_shared(dev, "reads")
                    if p is None:
                        p = probe(folder) if target is None else probe_reads(*target)
                        if p is not None:
                            _store_shared(dev, "full" if target is None else "reads", p)
            except OSError:                 # not writable here, or the file was taken away: the default, kept
                known = kept[dev] = (Choice(), Probe(write={}, read={}))
            else:
                if p is None:               # the file to read is in the page cache: probed later, on cold bytes
                    return Choice()
                known = kept[dev] = (choose(p), p)
    return known[0]


def probed() -> dict[int, tuple[Choice, Probe]]:
    """Every device probed so far in this process: ``st_dev`` → (choice, figures); a device probed for reads
    only has no write figures."""
    with _LOCK:
        return {**_READS, **_CHOICES}


def forget() -> None:
    """Drop every kept choice (the next large request probes again)."""
    with _LOCK:
        _CHOICES.clear()
        _READS.clear()
