"""The local I/O path, chosen per device at run time: O_DIRECT or the page cache, and how many requests in flight.

Which path is fastest depends on the device and on its hour: on these VMs O_DIRECT writes run at 2 GB/s on a
fast hour and below a buffered write (the kernel's writeback queues deep, merged requests) on a slow one. So
``PosixStorage`` asks, on its first large request (``PROBE_FROM`` bytes or more: small checkpoints and tests
never pay for it), for the ``Choice`` of its device: ``probe`` writes (with fsync) and reads (cold: O_DIRECT,
or buffered after ``POSIX_FADV_DONTNEED``) one short file in the storage's own folder on every path — O_DIRECT
and buffered, 1 and ``MANY`` requests in flight — and ``choose``, a pure function of those figures, keeps the
cheapest of the paths within ``MARGIN`` of the fastest. The choice is kept per device (``st_dev``) for the life of the process; ``forget`` drops it.
A file system that refuses O_DIRECT (tmpfs) has no O_DIRECT figures, so the choice is buffered.

``Choice`` is also what a caller forces: ``PosixStorage(root, direct_io=False, inflight=4)`` never probes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PAGE = 4096
PROBE_FROM = 8 << 20         # a request at least this large asks for the device's choice (probing it once)
PROBE_BYTES = 16 << 20       # written and read on every path, in every round, by the probe
PROBE_REQUEST = 4 << 20      # request size of the probe
MANY = 4                     # "several requests in flight" of the probe and the most ``choose`` picks
SPLIT_MIN = 1 << 20          # a request is split across threads in parts of at least this many bytes
MARGIN = 1.15                # paths this close to the fastest count as equal (the cheapest of them is chosen)
CACHE_WRITE_MARGIN = 1.5     # a buffered write must beat every O_DIRECT write by this much in the probe
ROUNDS = 2                   # the probe times every path this many times, interleaved, and keeps its best

Path = tuple[bool, int]      # (O_DIRECT, requests in flight)


@dataclass(frozen=True)
class Choice:
    """The path of one device: O_DIRECT or buffered, and requests in flight, for writes and for reads."""

    write_direct: bool = True
    write_inflight: int = 1
    read_direct: bool = True
    read_inflight: int = 1


@dataclass(frozen=True)
class Probe:
    """Measured bytes per second of each path (``(direct, inflight)``; O_DIRECT paths absent where refused)."""

    write: Mapping[Path, float]
    read: Mapping[Path, float]
    seconds: float = 0.0


def _pick(rates: Mapping[Path, float]) -> Path:
    """Among the paths within ``MARGIN`` of the fastest (a short probe is noisy), the cheapest: O_DIRECT before
    the page cache (no copy through it, no CPU paid for it), then the fewest requests in flight."""
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
    """The ``Choice`` for the figures of ``probe`` (pure: the same figures, the same choice). A buffered write
    must beat O_DIRECT by ``CACHE_WRITE_MARGIN`` in the probe: a short probe flatters it (its fsync flushes
    16 MiB of page cache; a save of GBs first touches every page-cache page, ~1 GB/s on these VMs)."""
    wd, wk = _pick(_direct_unless_cache_wins(probe.write, CACHE_WRITE_MARGIN))
    rd, rk = _pick(probe.read)
    return Choice(write_direct=wd, write_inflight=wk, read_direct=rd, read_inflight=rk)


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


def _write(fd: int, buf: mmap.mmap, inflight: int) -> None:
    def one(pos: int, n: int) -> int:
        view = memoryview(buf)[pos:pos + n]
        done = 0
        while done < n:
            done += os.pwrite(fd, view[done:], pos + done)
        return done

    requests = [(at, min(PROBE_REQUEST, PROBE_BYTES - at)) for at in range(0, PROBE_BYTES, PROBE_REQUEST)]
    for i in range(0, len(requests), inflight):
        in_parallel(one, requests[i:i + inflight])
    os.fsync(fd)


def _read(fd: int, buf: mmap.mmap, inflight: int) -> None:
    def one(pos: int, n: int) -> int:
        return os.preadv(fd, [memoryview(buf)[pos:pos + n]], pos)

    requests = [(at, min(PROBE_REQUEST, PROBE_BYTES - at)) for at in range(0, PROBE_BYTES, PROBE_REQUEST)]
    for i in range(0, len(requests), inflight):
        in_parallel(one, requests[i:i + inflight])


def probe(folder: str) -> Probe:
    """Time every path on one ``PROBE_BYTES`` file created (exclusively, never through a link) in ``folder``
    and removed after, ``ROUNDS`` times in alternating order, keeping each path's best (what the device can do,
    not what a neighbour's burst left of it); O_DIRECT paths the file system refuses are left out."""
    t0 = time.perf_counter()
    name = os.path.join(folder, f".liferaft-probe-{uuid.uuid4().hex[:12]}")
    buf = mmap.mmap(-1, PROBE_BYTES)
    buf.write(b"\x5a" * PROBE_BYTES)                   # prefaulted, page aligned
    write: dict[Path, float] = {}
    read: dict[Path, float] = {}
    paths = [(d, k) for d in ((True, False) if hasattr(os, "O_DIRECT") else (False,)) for k in (1, MANY)]
    try:
        for r in range(ROUNDS):
            for direct, k in (paths if r % 2 == 0 else paths[::-1]):
                if r and (direct, k) not in write:
                    continue                             # refused in the first round
                got = _time_path(name, buf, direct, k)
                if got is not None:
                    write[(direct, k)] = max(write.get((direct, k), 0.0), got[0])
                    read[(direct, k)] = max(read.get((direct, k), 0.0), got[1])
    finally:
        buf.close()
        if os.path.lexists(name):
            os.unlink(name)
    return Probe(write=write, read=read, seconds=time.perf_counter() - t0)


def _time_path(name: str, buf: mmap.mmap, direct: bool, k: int) -> tuple[float, float] | None:
    """(write + fsync, cold read) bytes per second of one path on a new file ``name`` (removed after); None
    where the file system refuses O_DIRECT."""
    flags = os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    d = os.O_DIRECT if direct else 0
    try:
        fd = os.open(name, flags | os.O_WRONLY | d, 0o600)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None
    try:
        try:
            t = time.perf_counter()
            _write(fd, buf, k)
            w = PROBE_BYTES / max(time.perf_counter() - t, 1e-9)
        finally:
            os.close(fd)
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | d)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            _read(fd, buf, k)
            return w, PROBE_BYTES / max(time.perf_counter() - t, 1e-9)
        finally:
            os.close(fd)
    finally:
        os.unlink(name)


_CHOICES: dict[int, tuple[Choice, Probe]] = {}
_LOCK = threading.Lock()


def choice_for(folder: str) -> Choice:
    """The ``Choice`` of ``folder``'s device: probed in ``folder`` on the first call for that device, then kept
    (a folder where the probe cannot write keeps the default ``Choice()``: O_DIRECT, one request in flight)."""
    dev = os.stat(folder).st_dev
    with _LOCK:
        known = _CHOICES.get(dev)
        if known is None:
            try:
                p = probe(folder)
            except OSError:                 # not writable here, or the file was taken away: the default, kept
                p = Probe(write={}, read={})
                known = _CHOICES[dev] = (Choice(), p)
            else:
                known = _CHOICES[dev] = (choose(p), p)
    return known[0]


def probed() -> dict[int, tuple[Choice, Probe]]:
    """Every device probed so far in this process: ``st_dev`` → (choice, figures)."""
    with _LOCK:
        return dict(_CHOICES)


def forget() -> None:
    """Drop every kept choice (the next large request probes again)."""
    with _LOCK:
        _CHOICES.clear()
