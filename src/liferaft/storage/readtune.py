"""The read path of a device, learned from the load's own reads: O_DIRECT or the page cache.

The probe (``storage.iopath``) ranks the paths once per device and process, on one 16 MiB file read by one
process. A load reads GBs, often from several processes at once, and on these VMs the faster path moves with the
hour: one hour O_DIRECT holds 1.4–1.5 GB/s while cold page-cache reads swing 0.65–2.8 GB/s; another, two ranks
loading 0.5 GiB each read steadily through the page cache in 0.45–0.54 s while O_DIRECT wanders 0.51–0.82 s. A
short probe cannot see which hour a GB-scale load will meet. So the cold read requests of ``PROBE_FROM`` bytes or
more by a storage that chooses its own path (``PosixStorage`` without ``direct_io``/``inflight``) go in runs of
``RUN`` consecutive requests on one path (``place``, ``finish``), and this process keeps, per device, a moving
average of each path's rate: a run's bytes over the wall time from the start of its first request to the end of
its last. A run takes the path with the better rate, except every ``EXPLORE``-th run, which takes the other so
its figure stays current; the first run takes the probe's path and the second the other.

Why runs and wall time, not each request's own time: the page cache reads ahead of a sequential reader (the
device's ``read_ahead_kb``) while the reader verifies and copies what it got, so its gain lies between the read
calls, and a lone page-cache request among O_DIRECT ones gets none of it (measured: lone requests rated the page
cache at 0.85 GB/s, below O_DIRECT's 0.95–1.4, while whole loads through it were the faster).

What teaches: a run whose window — the ``RUN`` requests' worth of the file from its first request — was at most
``WINDOW_COLD`` in the page cache when it started (the tail of a previous run's read-ahead fits; data already
in memory does not), whose later requests lie in that window or are cold themselves (at most ``COLD_MAX``), and
whose requests all succeeded. A run that pauses more than ``GAP_MAX`` between requests ends there (a load that
ended mid-run): with two requests or more it teaches the rate up to its last one. The exploring run comes once
the other path has gone ``EXPLORE`` - 1 runs without teaching, so an exploring run that could not teach is
followed by another — after 1, 2, 4, ... up to ``EXPLORE`` runs, so that a path whose runs cannot teach (the
loads' pattern) never takes more than one run in ``EXPLORE``. The figures are per process and per device (``forget`` drops them); requests from several threads at
once share one run (their rates mix; the bytes are never affected).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RUN = 4                 # consecutive large requests of a device on one path, timed together
EXPLORE = 8             # the other path gets a run once it has gone EXPLORE - 1 runs without teaching
ALPHA = 0.3             # weight of a new run's rate in the moving average (after the first few: their mean)
COLD_MAX = 0.05         # a request outside its run's window is cold with at most this share in the page cache
WINDOW_COLD = 0.1       # a run's window is cold with at most this share in the page cache when the run starts
GAP_MAX = 0.25          # seconds between two requests of a run beyond which the run ends there


@dataclass
class Rates:
    """A device's learned read rates (bytes/s, moving averages of whole runs) per path, and the run going on."""

    direct: float | None = None
    cached: float | None = None
    runs: int = 0                       # runs started
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})    # runs since each taught
    run_direct: bool = True             # the current run's path
    run_left: int = 0                   # requests the current run still takes
    run_done: int = 0                   # requests of the current run finished
    run_start: float = 0.0
    run_last: float = 0.0               # when the current run's last request ended
    run_bytes: int = 0
    run_ok: bool = False                # whether the current run may still teach
    run_explore: bool = False           # whether the current run explores the other path
    explored_at: int = -(1 << 30)       # ``runs`` when the last exploring run started
    backoff: int = 1                    # runs between exploring runs while they fail to teach (1, 2, 4, ... EXPLORE)
    window: tuple[Any, int, int] = (None, 0, 0)     # (file, first byte, end) of the current run's window

    def rate(self, direct: bool) -> float | None:
        return self.direct if direct else self.cached


_RATES: dict[int, Rates] = {}
_LOCK = threading.Lock()


def place(rates: Rates, probed: bool, now: float, file: Any, offset: int, length: int, cold: bool,
          window_cold: Callable[[int], bool]) -> bool:
    """Whether the next large request (``length`` bytes at ``offset`` of ``file``, any key naming the file;
    ``cold``: at most ``COLD_MAX`` of it in the page cache) reads by O_DIRECT, given ``rates`` and the probe's
    choice ``probed`` (pure but for ``rates``, where the request is placed, and ``window_cold(n)``: whether the
    ``n`` bytes of the file from ``offset`` are at most ``WINDOW_COLD`` in the page cache, asked when a run
    starts). A new run takes the probe's path until that has a figure, then the other until it has one; then
    the better rate (a tie: the probe's), or the worse once it has gone ``EXPLORE`` - 1 runs without teaching
    (and ``backoff`` runs have passed since the last exploring run: 1, doubled by each that failed to teach)."""
    if rates.run_left and now - rates.run_last > GAP_MAX:
        _end(rates)
    if rates.run_left == 0:
        if rates.rate(probed) is None:
            rates.run_direct = probed
        elif rates.rate(not probed) is None:
            rates.run_direct = not probed
        else:
            d, c = rates.direct or 0.0, rates.cached or 0.0
            best = probed if d == c else d > c
            explore = rates.since[not best] >= EXPLORE - 1 and rates.runs - rates.explored_at >= rates.backoff
            rates.run_direct = (not best) if explore else best
            rates.run_explore = explore
            if explore:
                rates.explored_at = rates.runs
        rates.runs += 1
        rates.since[True] += 1
        rates.since[False] += 1
        rates.run_left, rates.run_done, rates.run_start, rates.run_bytes = RUN, 0, now, 0
        rates.window = (file, offset, offset + RUN * length)
        rates.run_ok = window_cold(RUN * length)
    elif not cold and not (rates.window[0] == file and rates.window[1] <= offset
                           and offset + length <= rates.window[2]):
        rates.run_ok = False                    # warm data outside the window: its time would flatter the path
    rates.run_last = now
    return rates.run_direct


def finish(rates: Rates, nbytes: int, now: float, ok: bool = True) -> None:
    """A placed request has read ``nbytes`` and ended at ``now`` (pure but for ``rates``); the run's last one
    folds the run's rate into its path's average if the run may teach. ``ok`` False (the request failed, or
    could not take its path: the file system refused O_DIRECT) ends the run, teaching nothing."""
    if rates.run_left == 0:
        return
    if not ok:
        rates.run_ok = False
        _end(rates)
        return
    rates.run_bytes += max(0, nbytes)
    rates.run_left -= 1
    rates.run_done += 1
    rates.run_last = now
    if rates.run_left == 0:
        _end(rates)


def _end(rates: Rates) -> None:
    """End the current run: it teaches its rate (bytes over the time from its start to its last request's end)
    if it may and has at least two requests done (a whole run, or one a pause cut short)."""
    taught = rates.run_ok and rates.run_done >= 2 and rates.run_bytes > 0 and rates.run_last > rates.run_start
    if taught:
        learn(rates, rates.run_direct, rates.run_bytes, rates.run_last - rates.run_start)
    if rates.run_explore:               # a failed exploration waits twice as long before the next, up to EXPLORE
        rates.backoff = 1 if taught else min(2 * rates.backoff, EXPLORE)
    rates.run_left, rates.run_ok, rates.run_explore = 0, False, False


def learn(rates: Rates, direct: bool, nbytes: int, seconds: float) -> None:
    """Fold one rate, ``nbytes`` in ``seconds``, into ``direct``'s average (pure but for ``rates``): the mean of the
    first ones, then a moving average weighing the new one ``ALPHA``; no bytes or no time teaches nothing."""
    if nbytes <= 0 or seconds <= 0:
        return
    now = nbytes / seconds
    old = rates.rate(direct)
    alpha = max(ALPHA, 1 / (rates.samples[direct] + 1))     # the plain mean of the first few: one odd run fades
    new = now if old is None else (1 - alpha) * old + alpha * now
    if direct:
        rates.direct = new
    else:
        rates.cached = new
    rates.samples[direct] += 1
    rates.since[direct] = 0


def start(device: int, probed: bool, file: Any, offset: int, length: int, cold: bool,
          window_cold: Callable[[int], bool]) -> bool:
    """``place`` a request of ``device`` (``st_dev``) with this process's figures; O_DIRECT or not."""
    with _LOCK:
        return place(_RATES.setdefault(device, Rates()), probed, time.perf_counter(), file, offset, length, cold,
                     window_cold)


def done(device: int, nbytes: int, ok: bool = True) -> None:
    """``finish`` the request of ``device`` that ``start`` placed."""
    with _LOCK:
        r = _RATES.get(device)
        if r is not None:
            finish(r, nbytes, time.perf_counter(), ok)


def rates_of(device: int) -> Rates | None:
    """A copy of ``device``'s learned figures (None: none yet)."""
    with _LOCK:
        r = _RATES.get(device)
        if r is None:
            return None
        return Rates(**{**r.__dict__, "samples": dict(r.samples), "since": dict(r.since)})


def forget() -> None:
    """Drop every device's learned figures."""
    with _LOCK:
        _RATES.clear()
