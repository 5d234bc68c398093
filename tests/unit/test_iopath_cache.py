"""Reads of data already in the page cache go through it (``iopath.resident_share``, ``cache_read_wins``,
``Choice.cache_floor``; ``PosixStorage.read_into``): the rule is a pure function of measured numbers, residency
is told on real files (hot after a buffered write, cold after fsync + POSIX_FADV_DONTNEED), and a read on either
path returns the file's bytes exactly. Also the save's writes behind the hashing (``core.chunks.behind``)."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import liferaft
from liferaft.core.chunks.behind import WriteBehind
from liferaft.storage import PosixStorage, iopath
from liferaft.storage.iopath import MIN_RESIDENT, Choice, Probe, cache_floor, cache_read_wins, choose

GB = 1e9
MIB = 1 << 20


def _real_disk(tmp_path) -> str:
    """A folder on a file system with a page cache and O_DIRECT (not tmpfs), or skip."""
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


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# ------------------------------------------------------------------ the rule, pure


def test_cache_floor_is_half_unless_buffered_cold_reads_are_much_slower():
    assert cache_floor({(True, 1): 1.0 * GB, (False, 1): 0.9 * GB}) == MIN_RESIDENT
    assert cache_floor({(True, 1): 2.0 * GB, (True, 4): 2.0 * GB, (False, 1): 0.5 * GB}) == pytest.approx(0.75)
    assert cache_floor({(True, 1): 1.0 * GB, (False, 1): 0.0}) == MIN_RESIDENT     # no buffered figure
    assert cache_floor({(False, 1): 1.0 * GB}) == MIN_RESIDENT                     # O_DIRECT refused
    assert cache_floor({}) == MIN_RESIDENT


@given(st.floats(1e6, 1e10), st.floats(1e6, 1e10), st.floats(0, 1))
def test_cache_read_wins_exactly_when_the_cached_path_costs_no_more(d, b, r):
    floor = cache_floor({(True, 1): d, (False, 1): b})
    assert MIN_RESIDENT <= floor <= 1.0
    wins = cache_read_wins(r, floor)
    assert wins == (r > 0 and r >= floor)
    if wins:        # through the cache: (1 - r)/b (cached pages free) against 1/d by O_DIRECT
        assert (1 - r) / b <= 1 / d * (1 + 1e-9)


def test_cache_read_never_wins_unknown_or_cold():
    assert not cache_read_wins(None, 0.5)
    assert not cache_read_wins(0.0, 0.5)
    assert not cache_read_wins(0.49, 0.5)
    assert cache_read_wins(0.5, 0.5) and cache_read_wins(1.0, 0.9)


def test_choose_carries_the_floor_of_its_read_figures():
    p = Probe(write={(True, 1): 1.0 * GB}, read={(True, 1): 2.0 * GB, (False, 1): 0.4 * GB})
    assert choose(p).cache_floor == pytest.approx(0.8)
    assert Choice().cache_floor == MIN_RESIDENT


# ------------------------------------------------------------------ residency on real files


def test_resident_share_tells_hot_from_evicted_on_a_real_file(tmp_path):
    d = _real_disk(tmp_path)
    path = os.path.join(d, "f.bin")
    _write(path, os.urandom(8 * MIB))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert iopath.resident_share(fd, 0, 8 * MIB) == pytest.approx(1.0, abs=0.05)   # just written buffered
        _evict(path)
        assert iopath.resident_share(fd, 0, 8 * MIB) <= 0.05
        os.pread(fd, 2 * MIB, 0)                                   # read the first quarter again
        assert iopath.resident_share(fd, 0, 2 * MIB) == pytest.approx(1.0, abs=0.05)
        assert iopath.resident_share(fd, 4 * MIB, 4 * MIB) <= 0.5   # (readahead may bring a little more)
        assert iopath.resident_share(fd, 64 * MIB, MIB) == 0.0     # past the end of the file
        assert iopath.resident_share(fd, 8 * MIB - 100, 1 << 30) is not None   # clamped to the file
        assert iopath.resident_share(fd, 0, 0) is None
    finally:
        os.close(fd)


def test_resident_share_reads_nothing_and_changes_nothing(tmp_path):
    d = _real_disk(tmp_path)
    path = os.path.join(d, "f.bin")
    data = os.urandom(4 * MIB)
    _write(path, data)
    _evict(path)
    before = os.stat(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3):
            assert iopath.resident_share(fd, 0, 4 * MIB) <= 0.05    # asking faults nothing in
    finally:
        os.close(fd)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with open(path, "rb") as f:
        assert f.read() == data


def _aligned(n: int) -> torch.Tensor:
    from liferaft.staging.pool import page_aligned_empty

    return page_aligned_empty(n)


@pytest.mark.parametrize("hot", [True, False])
def test_auto_storage_reads_hot_data_through_the_cache_and_cold_data_by_its_path(tmp_path, hot):
    d = _real_disk(tmp_path)
    iopath.forget()
    try:
        c = iopath.choice_for(d)                 # the device's path, probed first (on an unnamed file) ...
        if not c.read_direct:                    # ... and made O_DIRECT for reads if the probe chose the cache
            c = Choice(c.write_direct, c.write_inflight, True, 1, c.cache_floor)
            iopath._CHOICES[os.stat(d).st_dev] = (c, iopath._CHOICES[os.stat(d).st_dev][1])
        data = os.urandom(16 * MIB)
        _write(os.path.join(d, "data.bin"), data)
        if not hot:
            _evict(os.path.join(d, "data.bin"))
        fd = os.open(os.path.join(d, "data.bin"), os.O_RDONLY)
        try:
            r = iopath.resident_share(fd, 0, 16 * MIB)
        finally:
            os.close(fd)
        s = PosixStorage(d)
        out = _aligned(16 * MIB)
        assert s.read_into("data.bin", 0, memoryview(out.numpy())) == 16 * MIB
        assert bytes(out.numpy()) == data
        if hot and r is not None and r >= c.cache_floor:    # (memory pressure may have taken pages since)
            assert s.cached_reads > 0
        if not hot:
            assert s.cached_reads == 0
        small = _aligned(64 << 10)                 # a small aligned read (no probe) follows the same rule
        assert PosixStorage(d).read_into("data.bin", 1 << 20, memoryview(small.numpy())) == 64 << 10
        assert bytes(small.numpy()) == data[1 << 20:(1 << 20) + (64 << 10)]
    finally:
        iopath.forget()


def test_the_read_probe_leaves_a_hot_file_in_the_page_cache(tmp_path):
    d = _real_disk(tmp_path)
    path = os.path.join(d, "data.bin")
    _write(path, os.urandom(16 * MIB))

    def open_file(direct: bool) -> int:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))

    fd = os.open(path, os.O_RDONLY)
    try:
        before = iopath.resident_share(fd, 0, 16 * MIB)
        if before is None or before < MIN_RESIDENT:
            pytest.skip("the page cache did not keep a just-written file (memory pressure)")
        assert iopath.probe_reads(open_file, 16 * MIB) is None          # nothing measured ...
        assert iopath.resident_share(fd, 0, 16 * MIB) >= MIN_RESIDENT   # ... and nothing dropped
        _evict(path)
        p = iopath.probe_reads(open_file, 16 * MIB)                       # cold: measured as before
        assert p is not None and p.read and not p.write
    finally:
        os.close(fd)


def test_forced_o_direct_is_never_redirected_to_the_cache(tmp_path):
    d = _real_disk(tmp_path)
    data = os.urandom(4 * MIB)
    _write(os.path.join(d, "data.bin"), data)       # hot
    s = PosixStorage(d, direct_io=True, inflight=1)
    out = _aligned(4 * MIB)
    assert s.read_into("data.bin", 0, memoryview(out.numpy())) == 4 * MIB
    assert bytes(out.numpy()) == data and s.cached_reads == 0


@pytest.mark.parametrize("evict", [False, True])
def test_load_right_after_save_round_trips_hot_or_evicted(tmp_path, evict):
    d = _real_disk(tmp_path)
    state = {f"t{i}": torch.randn(1 << 20 if i % 2 else 1000 + i) for i in range(6)}
    liferaft.save(os.path.join(d, "ck"), state)
    if evict:
        for root, _, names in os.walk(os.path.join(d, "ck")):
            for n in names:
                _evict(os.path.join(root, n))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(os.path.join(d, "ck"), target)
    assert all(torch.equal(target[k], state[k]) for k in state)


# ------------------------------------------------------------------ writes behind the hashing


def test_write_behind_runs_jobs_in_order_on_one_thread():
    wb = WriteBehind()
    seen: list[tuple[int, str]] = []
    for i in range(50):
        wb.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    wb.flush()
    assert [i for i, _ in seen] == list(range(50))
    assert {n for _, n in seen} == {"liferaft-write"}
    wb.close()


def test_write_behind_raises_the_first_error_and_drops_the_rest():
    wb = WriteBehind()
    gate = threading.Event()
    ran: list[int] = []
    wb.submit(lambda: gate.wait())
    wb.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    wb.submit(lambda: ran.append(3))
    gate.set()
    with pytest.raises(OSError, match="No space"):
        wb.flush()
    assert ran == []
    with pytest.raises(OSError, match="No space"):
        wb.submit(lambda: ran.append(4))
    wb.close()
    assert ran == []


def test_write_behind_close_waits_for_the_running_job_and_skips_the_queue():
    wb = WriteBehind()
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def first() -> None:
        started.set()
        gate.wait()
        ran.append(1)

    wb.submit(first)
    wb.submit(lambda: ran.append(2))
    started.wait()
    threading.Timer(0.05, gate.set).start()
    wb.close()                          # returns only after ``first`` ended
    assert ran == [1]
