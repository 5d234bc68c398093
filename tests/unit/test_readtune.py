"""storage.readtune: the read path learned from a load's own cold reads. The schedule and the averages are pure
(runs of RUN requests timed whole, the probe's path first, then the other, then the better, every EXPLORE-th run
the worse; only a run that started cold teaches); on a real disk an auto PosixStorage learns both paths from cold
reads, returns the file's bytes on either, and learns nothing from data already in the page cache."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest

from liferaft.staging.pool import page_aligned_empty
from liferaft.storage import PosixStorage, iopath, readtune
from liferaft.storage.readtune import ALPHA, EXPLORE, GAP_MAX, RUN, Rates, finish, learn, place

MIB = 1 << 20


def _run(rates: Rates, probed: bool, seconds: float = 1.0, nbytes: int = 100, cold: bool = True,
         t0: float = 0.0, requests: int = RUN) -> bool:
    """``requests`` requests of one run (of ``nbytes`` each, sequential in file "f", over ``seconds``); its path."""
    paths = set()
    for i in range(requests):
        paths.add(place(rates, probed, t0 + i * seconds / RUN, "f", i * nbytes, nbytes, True, lambda n: cold))
        finish(rates, nbytes, t0 + (i + 1) * seconds / RUN)
    assert len(paths) == 1, "a run changed path"
    return paths.pop()


@pytest.mark.parametrize("probed", [True, False])
def test_the_probes_path_first_then_the_other_then_the_better(probed):
    r = Rates()
    assert _run(r, probed, seconds=2.0) is probed
    assert r.rate(probed) == 4 * 100 / 2.0 and r.rate(not probed) is None     # a run's bytes over its wall time
    assert _run(r, probed, seconds=1.0) is (not probed)
    assert r.rate(not probed) == 400.0
    assert _run(r, probed) is (not probed)          # the other path is the faster now
    r2 = Rates()
    _run(r2, probed)
    _run(r2, probed)
    assert _run(r2, probed) is probed               # a tie goes to the probe's path


def test_the_other_path_gets_one_run_in_explore():
    r = Rates()
    learn(r, True, 100, 1.0)
    learn(r, False, 300, 1.0)                       # the page cache is 3x faster
    paths = [_run(r, True, seconds=1.0, nbytes=75) for _ in range(3 * EXPLORE)]
    assert [i for i, p in enumerate(paths) if p] == [EXPLORE - 1, 2 * EXPLORE - 1, 3 * EXPLORE - 1]


def test_an_exploring_run_that_cannot_teach_is_followed_by_another():
    r = Rates()
    learn(r, True, 100, 1.0)
    learn(r, False, 300, 1.0)
    t = 0.0
    for _ in range(EXPLORE - 1):
        t += 10
        assert _run(r, True, t0=t, nbytes=75) is False
    t += 10
    assert _run(r, True, t0=t, requests=1) is True  # the exploring run: one request, then the load ends
    t += 10
    assert _run(r, True, t0=t, nbytes=75) is False  # (its pause ends it, teaching nothing): one run between,
    t += 10
    assert _run(r, True, t0=t, nbytes=25) is True   # then explore again
    assert r.samples[True] == 2 and r.direct == pytest.approx((1 - ALPHA) * 100 + ALPHA * 100)
    assert r.backoff == 1


def test_a_path_whose_runs_never_teach_gets_at_most_one_run_in_explore():
    r = Rates()
    learn(r, True, 100, 1.0)
    learn(r, False, 300, 1.0)
    paths = []
    for k in range(8 * EXPLORE):                    # the page cache teaches; O_DIRECT runs are always spoiled
        d = place(r, True, 10.0 * k, "f", 0, 100, True, lambda n: True)
        paths.append(d)
        if d:
            finish(r, 0, 10.0 * k + 1, ok=False)
        else:
            for i in range(RUN):
                finish(r, 75, 10.0 * k + 0.25 * (i + 1))
                if i < RUN - 1:
                    place(r, True, 10.0 * k + 0.25 * (i + 1), "f", 75 * (i + 1), 75, True, lambda n: True)
    gaps = [b - a for a, b in itertools.pairwise([i for i, d in enumerate(paths) if d])]
    assert gaps[:3] == [2, 4, EXPLORE] and set(gaps[3:]) == {EXPLORE} and r.backoff == EXPLORE


def test_a_run_that_starts_warm_fails_or_cannot_take_its_path_teaches_nothing():
    r = Rates()
    _run(r, True, cold=False)                       # its window was in the page cache
    assert r.direct is None and r.samples == {True: 0, False: 0} and r.runs == 1
    place(r, True, 0.0, "f", 0, 100, True, lambda n: True)
    finish(r, 100, 0.1)
    place(r, True, 0.1, "f", 100, 100, True, lambda n: True)
    finish(r, 0, 5.0, ok=False)                     # a request failed (EIO), or O_DIRECT was refused
    assert r.run_left == 0 and r.direct is None
    finish(r, 100, 6.0)                             # (a request outside any run changes nothing)
    assert r.direct is None and r.samples == {True: 0, False: 0}


def test_warm_data_outside_the_window_spoils_the_run_inside_it_does_not():
    r = Rates()
    for i in range(RUN):                            # the second request: another file, warm (it would flatter)
        f, cold = ("g", False) if i == 1 else ("f", True)
        place(r, True, 0.1 * i, f, 100 * i, 100, cold, lambda n: True)
        finish(r, 100, 0.1 * (i + 1))
    assert r.run_left == 0 and r.direct is None and r.samples[True] == 0
    r = Rates()
    for i in range(RUN):                            # warm (read ahead by this run) but inside its window
        place(r, True, 0.1 * i, "f", 100 * i, 100, i == 0, lambda n: True)
        finish(r, 100, 0.1 * (i + 1))
    assert r.direct == pytest.approx(RUN * 100 / (0.1 * RUN))


def test_a_run_paused_between_requests_ends_there_and_teaches_up_to_its_last_request():
    r = Rates()
    for i in range(RUN - 1):                        # a load that ends mid-run ...
        place(r, True, i * 0.1, "f", i * 100, 100, True, lambda n: True)
        finish(r, 100, i * 0.1 + 0.05)
    assert r.run_left == 1 and r.direct is None
    t = GAP_MAX + 60.0                              # ... and the next load a minute later
    assert place(r, True, t, "f", 0, 100, True, lambda n: True) is False and r.runs == 2    # a new run
    assert r.direct == pytest.approx((RUN - 1) * 100 / ((RUN - 2) * 0.1 + 0.05))         # not the pause


def test_the_average_follows_the_device_and_ignores_empty_runs():
    r = Rates()
    learn(r, True, 0, 1.0)
    learn(r, True, 100, 0.0)
    assert r.direct is None and r.samples[True] == 0
    for _ in range(20):
        learn(r, True, 400, 1.0)
    assert r.direct == pytest.approx(400) and r.samples[True] == 20
    learn(r, True, 10, 1.0)                         # one slow run moves it, by ALPHA only
    assert r.direct == pytest.approx((1 - ALPHA) * 400 + ALPHA * 10)
    assert r.cached is None


def _disk(tmp_path) -> str:
    for base in (str(tmp_path), "/var/tmp", os.getcwd()):
        try:
            d = tempfile.mkdtemp(dir=base)
            fd = os.open(os.path.join(d, "probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            os.close(fd)
            os.unlink(os.path.join(d, "probe"))
            return d
        except (OSError, AttributeError):
            continue
    pytest.skip("no file system with O_DIRECT here")


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_an_auto_storage_learns_both_paths_from_cold_reads_and_nothing_from_cached_ones(tmp_path):
    d = _disk(tmp_path)
    iopath.forget()
    try:
        req = iopath.PROBE_FROM
        data = os.urandom(RUN * req)
        path = os.path.join(d, "data.bin")
        with open(path, "wb") as f:
            f.write(data)
        dev = os.stat(d).st_dev
        out = page_aligned_empty(req)

        def read_all(s: PosixStorage) -> None:
            for i in range(RUN):
                assert s.read_into("data.bin", i * req, memoryview(out.numpy())) == req
                assert bytes(out.numpy()) == data[i * req:(i + 1) * req]

        for _ in range(2):                          # cold: two runs, the probe's path and then the other
            _evict(path)
            read_all(PosixStorage(d))
        got = readtune.rates_of(dev)
        assert got is not None and got.runs == 2 and got.run_left == 0
        if got.samples != {True: 1, False: 1}:
            pytest.skip("memory pressure or a neighbour kept the evicted file from being cold")
        assert got.direct and got.cached
        with open(path, "rb") as f:                 # hot: every page in the cache
            f.read()
        s = PosixStorage(d)
        read_all(s)
        after = readtune.rates_of(dev)
        assert after is not None and after.runs == 3 and after.samples == got.samples    # nothing learned
        assert (after.direct, after.cached) == (got.direct, got.cached)
        assert s.cached_reads == RUN                # ... and every request read through the cache
        _evict(path)
        read_all(PosixStorage(d, direct_io=True, inflight=1))     # a forced path neither asks nor teaches
        assert readtune.rates_of(dev).runs == 3
    finally:
        iopath.forget()
    assert readtune.rates_of(dev) is None
