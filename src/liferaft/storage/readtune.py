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
cache at 0.85 GB/s, below O_DIRECT's 0.95–1.4, while whole loads through it were the faster). A request the page
cache already holds (``iopath.cache_read_wins``: the read-ahead of the run before it, say) reads through it but
still counts in its run. Only a run whose first request was cold (at most ``COLD_MAX`` of its pages in the page
cache) teaches, so data already in memory never flatters the page cache. The figures live for the process
(``forget`` drops them).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

RUN = 4                 # consecutive large requests of a device on one path, timed together
EXPLORE = 8             # every EXPLORE-th run of a device takes the path with the worse rate
ALPHA = 0.3             # weight of a new run's rate in the moving average
COLD_MAX = 0.05         # a run teaches only if at most this share of its first request's pages was in the cache
GAP_MAX = 0.25          # seconds between two requests of a run beyond which the run is dropped, teaching nothing


@dataclass
class Rates:
    """A device's learned read rates (bytes/s, moving averages of whole runs) per path, and the run going on."""

    direct: float | None = None
    cached: float | None = None
    runs: int = 0                       # runs started
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    run_direct: bool = True             # the current run's path
    run_left: int = 0                   # requests the current run still takes
    run_start: float = 0.0
    run_bytes: int = 0
    run_cold: bool = False
    run_last: float = 0.0               # when the current run's last request ended

    def rate(self, direct: bool) -> float | None:
        return self.direct if direct else self.cached


_RATES: dict[int, Rates] = {}
_LOCK = threading.Lock()


def place(rates: Rates, probed: bool, cold: bool, now: float) -> bool:
    """Whether the next large request reads by O_DIRECT, given ``rates`` and the probe's choice ``probed`` (pure
    but for ``rates``, where the request is placed; ``cold``: whether its range is cold, ``now``: its start).
    A new run takes the probe's path until that has a figure, then the other until it has one; then the better
    rate (a tie: the probe's), and every ``EXPLORE``-th run the worse. A run whose last request ended more than
    ``GAP_MAX`` ago (a load that ended mid-run, the next one starting later) is dropped: its time would count
    the pause."""
    if rates.run_left and now - rates.run_last > GAP_MAX:
        rates.run_left = 0
    if rates.run_left == 0:
        if rates.rate(probed) is None:
            rates.run_direct = probed
        elif rates.rate(not probed) is None:
            rates.run_direct = not probed
        else:
            d, c = rates.direct or 0.0, rates.cached or 0.0
            best = probed if d == c else d > c
            rates.run_direct = (not best) if (rates.runs + 1) % EXPLORE == 0 else best
        rates.runs += 1
        rates.run_left, rates.run_start, rates.run_bytes, rates.run_cold = RUN, now, 0, cold
    rates.run_last = now
    return rates.run_direct


def finish(rates: Rates, nbytes: int, now: float, ok: bool = True) -> None:
    """A placed request has read ``nbytes`` and ended at ``now`` (pure but for ``rates``): the run's last
    request folds the run's rate into its path's average, if its first request was cold. ``ok`` False (the
    request could not take its path: the file system refused O_DIRECT) ends the run, teaching nothing."""
    if rates.run_left == 0:
        return
    if not ok:
        rates.run_left = 0
        return
    rates.run_bytes += max(0, nbytes)
    rates.run_left -= 1
    rates.run_last = now
    if rates.run_left == 0 and rates.run_cold:
        learn(rates, rates.run_direct, rates.run_bytes, now - rates.run_start)


def learn(rates: Rates, direct: bool, nbytes: int, seconds: float) -> None:
    """Fold one rate, ``nbytes`` in ``seconds``, into ``direct``'s average (pure but for ``rates``); no bytes or
    no time teaches nothing."""
    if nbytes <= 0 or seconds <= 0:
        return
    now = nbytes / seconds
    old = rates.rate(direct)
    new = now if old is None else (1 - ALPHA) * old + ALPHA * now
    if direct:
        rates.direct = new
    else:
        rates.cached = new
    rates.samples[direct] += 1


def start(device: int, probed: bool, cold: bool) -> bool:
    """``place`` a request of ``device`` (``st_dev``) with this process's figures; O_DIRECT or not."""
    with _LOCK:
        return place(_RATES.setdefault(device, Rates()), probed, cold, time.perf_counter())


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
        return None if r is None else Rates(r.direct, r.cached, r.runs, dict(r.samples), r.run_direct, r.run_left,
                                            r.run_start, r.run_bytes, r.run_cold, r.run_last)


def forget() -> None:
    """Drop every device's learned figures."""
    with _LOCK:
        _RATES.clear()
