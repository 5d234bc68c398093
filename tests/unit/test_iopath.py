"""The local I/O path chosen at run time (``storage/iopath.py``, ``PosixStorage(direct_io=, inflight=)``): the
choice is a pure function of measured figures; the probe runs on a real folder; every forced path round-trips
bit-exact; a file system that refuses O_DIRECT (tmpfs) falls back to the page cache."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import liferaft
from liferaft.errors import LiferaftError, OptionsError
from liferaft.storage import PosixStorage, iopath
from liferaft.storage.iopath import Choice, Probe, choose, spans

GB = 1e9


def _probe(write: dict, read: dict | None = None) -> Probe:
    return Probe(write=write, read=read if read is not None else write)


def test_choice_keeps_direct_one_in_flight_when_nothing_beats_it_by_the_margins():
    p = _probe({(True, 1): 1.0 * GB, (True, 4): 1.1 * GB, (False, 1): 0.9 * GB, (False, 4): 1.05 * GB})
    assert choose(p) == Choice(True, 1, True, 1)


def test_choice_on_a_slow_hour_takes_more_requests_in_flight_before_the_page_cache():
    # the slow hour: O_DIRECT one at a time ~0.5 GB/s, the page cache's writeback faster
    p = _probe(write={(True, 1): 0.5 * GB, (True, 4): 0.72 * GB, (False, 1): 0.55 * GB, (False, 4): 0.8 * GB},
               read={(True, 1): 1.2 * GB, (True, 4): 1.25 * GB, (False, 1): 0.9 * GB, (False, 4): 1.0 * GB})
    assert choose(p) == Choice(write_direct=True, write_inflight=4, read_direct=True, read_inflight=1)


@pytest.mark.parametrize("side", ["write", "read"])
def test_choice_takes_the_page_cache_only_when_it_wins_by_the_cache_margin(side):
    m = iopath.CACHE_MARGIN
    direct = {(True, 1): 0.5 * GB, (True, 4): 0.52 * GB}

    def got(cached: float) -> tuple[bool, int]:
        rates = {**direct, (False, 1): 0.5 * GB, (False, 4): cached}
        c = choose(_probe(write=rates if side == "write" else direct, read=rates if side == "read" else direct))
        return (c.write_direct, c.write_inflight) if side == "write" else (c.read_direct, c.read_inflight)

    assert got(0.52 * m * 0.99 * GB)[0]               # 1.49x the best O_DIRECT path: still O_DIRECT
    assert got(0.52 * m * 1.01 * GB) == (False, 4)
    # the boundary: exactly CACHE_MARGIN times the best O_DIRECT path takes the cache, a byte less does not
    direct = {(True, 1): 1e9, (True, 4): 0.9e9}
    assert m == 1.5 and got(1.5e9) == (False, 4) and got(1.5e9 - 1)[0]
    # 2026-12-06's probe on this VM: the cache read 1.36x O_DIRECT, whole loads by O_DIRECT ran 1.4x faster
    p = _probe(write=direct, read={(False, 1): 2.71 * GB, (False, 4): 1.98 * GB, (True, 1): 1.99 * GB,
                                   (True, 4): 2.03 * GB})
    assert (choose(p).read_direct, choose(p).read_inflight) == (True, 1)


def test_choice_of_near_equals_is_direct_first_then_fewer_in_flight():
    p = _probe({(True, 1): 1.0 * GB, (True, 4): 2.0 * GB, (False, 1): 2.1 * GB, (False, 4): 1.9 * GB})
    assert (choose(p).read_direct, choose(p).read_inflight) == (True, 4)
    assert (choose(p).write_direct, choose(p).write_inflight) == (True, 4)
    p = _probe({(True, 1): 1.0 * GB, (True, 4): 1.2 * GB, (False, 1): 1.0 * GB})
    assert (choose(p).read_direct, choose(p).read_inflight) == (True, 4)   # faster by MARGIN: more in flight
    p = _probe({(True, 1): 1.0 * GB, (True, 4): 1.0 * GB, (False, 1): 2.0 * GB, (False, 4): 1.95 * GB})
    assert (choose(p).read_direct, choose(p).read_inflight) == (False, 1)  # the cache 2x faster: taken
    p = _probe({(True, 1): 1.0 * GB, (True, 4): 1.1 * GB, (False, 1): 0.9 * GB})
    assert choose(p) == Choice(True, 1, True, 1)


def test_choice_without_direct_figures_is_buffered():
    assert choose(_probe({(False, 1): 3 * GB, (False, 4): 2 * GB})) == Choice(False, 1, False, 1)
    assert choose(_probe({(False, 1): 1 * GB, (False, 4): 2 * GB})) == Choice(False, 4, False, 4)
    assert choose(_probe({})) == Choice(False, 1, False, 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(1e6, 1e10), min_size=8, max_size=8))
def test_choice_is_never_much_slower_than_the_best_measured_path(v):
    write = {(True, 1): v[0], (True, 4): v[1], (False, 1): v[2], (False, 4): v[3]}
    read = {(True, 1): v[4], (True, 4): v[5], (False, 1): v[6], (False, 4): v[7]}
    got = choose(Probe(write=write, read=read))
    for rates, direct, inflight in ((read, got.read_direct, got.read_inflight),
                                    (write, got.write_direct, got.write_inflight)):
        r = rates[(direct, inflight)]
        best_direct = max(rates[(True, 1)], rates[(True, 4)])
        best_cache = max(rates[(False, 1)], rates[(False, 4)])
        # O_DIRECT: within MARGIN of the best O_DIRECT path, the cache not ahead by CACHE_MARGIN; the cache:
        # within MARGIN of the best path, ahead of every O_DIRECT path by CACHE_MARGIN
        assert r * iopath.MARGIN >= best_direct and best_cache < iopath.CACHE_MARGIN * best_direct if direct \
            else r * iopath.MARGIN >= max(rates.values()) and best_cache >= iopath.CACHE_MARGIN * best_direct
    assert choose(Probe(write=dict(write), read=dict(read))) == got      # pure: same figures, same choice


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 40), st.integers(0, 64 << 20), st.integers(1, 16))
def test_spans_cover_the_request_exactly_on_page_steps(offset, length, inflight):
    parts = spans(offset, length, inflight)
    assert 1 <= len(parts) <= inflight
    assert parts[0][0] == offset and sum(n for _, n in parts) == length
    for (a, n), (b, _) in itertools.pairwise(parts):
        assert b == a + n and (b - offset) % iopath.PAGE == 0 and n >= iopath.SPLIT_MIN


def test_probe_on_a_real_folder_measures_every_path_and_leaves_nothing(tmp_path):
    p = iopath.probe(str(tmp_path))
    assert {(False, 1), (False, iopath.MANY)} <= set(p.write) and set(p.write) == set(p.read)
    assert all(v > 0 for v in [*p.write.values(), *p.read.values()])
    assert os.listdir(tmp_path) == []
    c = choose(p)
    assert c.write_inflight in (1, iopath.MANY) and c.read_inflight in (1, iopath.MANY)


MIB = 1 << 20


def test_the_read_rate_is_the_steady_state_past_the_read_ahead_ramp():
    # a cold buffered read: its first 16 MiB at 1 GB/s (read-ahead growing), the next 32 MiB at 4 GB/s
    marks = [(0, 0.0)]
    for k in range(1, 13):
        n = k * 4 * MIB
        marks.append((n, marks[-1][1] + 4 * MIB / (1e9 if n <= iopath.READ_RAMP else 4e9)))
    assert iopath.steady_rate(marks) == pytest.approx(4e9)
    # fewer bytes past the ramp than in it: the whole read counts
    short = marks[:7]
    assert iopath.steady_rate(short) == pytest.approx(short[-1][0] / short[-1][1])
    # groups of requests that straddle the ramp: timed from the first group ending at or past it
    grouped = [marks[0], marks[3], marks[6], marks[9], marks[12]]      # 12 MiB per group
    assert iopath.steady_rate(grouped) == pytest.approx((48 - 24) * MIB / (grouped[-1][1] - grouped[2][1]))


@pytest.mark.parametrize("inflight", [1, iopath.MANY])
def test_a_probe_read_reads_every_byte_into_the_reused_buffer(tmp_path, inflight):
    import mmap

    nbytes = 40 * MIB + 3 * iopath.PAGE                      # past the ramp, not a whole number of requests
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes())
    buf = mmap.mmap(-1, 16 * MIB)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert iopath._read(fd, buf, inflight, nbytes) > 0
    finally:
        os.close(fd)
    got = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    # the last requests landed at their offset modulo the buffer: the file's last 16 MiB, rotated
    tail = torch.arange(nbytes - 16 * MIB, nbytes)
    assert torch.equal(got[tail % (16 * MIB)], data[tail])
    buf.close()


def test_probe_reads_times_past_the_ramp_of_a_large_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(iopath.READ_BYTES + 8 * MIB))
    os.sync()

    def open_file(direct: bool) -> int:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    fd = open_file(False)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    p = iopath.probe_reads(open_file, os.path.getsize(path))
    assert p is not None and (False, 1) in p.read and all(v > 0 for v in p.read.values())


def _shm_dir() -> str:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    return tempfile.mkdtemp(dir="/dev/shm", prefix="liferaft-iopath-")


def _direct_allowed(folder: str) -> bool:
    """Whether ``folder``'s file system takes O_DIRECT (tmpfs refused it before Linux 6.6, takes it since)."""
    name = os.path.join(folder, "direct-check")
    try:
        fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def test_probe_on_tmpfs_measures_what_it_allows_and_chooses_accordingly():
    d = _shm_dir()
    try:
        p = iopath.probe(d)
        assert {(False, 1), (False, iopath.MANY)} <= set(p.write)
        direct = {k for k in p.write if k[0]}
        assert bool(direct) == _direct_allowed(d)        # refused: no O_DIRECT figure, so never chosen
        if not direct:
            assert not choose(p).write_direct and not choose(p).read_direct
        assert os.listdir(d) == []
    finally:
        os.rmdir(d)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # one tensor over PROBE_FROM (the auto path probes and splits), one odd-sized (partial pages), one tiny
    return {"big": torch.randn((iopath.PROBE_FROM + 3 * 4096 + 12) // 4, generator=g),
            "odd": torch.randn(300_001, generator=g), "tiny": torch.arange(5, dtype=torch.int64)}


def _round_trip(root: str, direct_io: bool | None, inflight: int | None) -> None:
    state = _state()
    liferaft.save(PosixStorage(root, direct_io=direct_io, inflight=inflight), state)
    out = {k: torch.full_like(v, -1) for k, v in state.items()}
    liferaft.load(PosixStorage(root, direct_io=direct_io, inflight=inflight), out)
    for k, v in state.items():
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), (k, direct_io, inflight)


@pytest.mark.parametrize("direct_io", [True, False, None])
@pytest.mark.parametrize("inflight", [1, 3, None])
def test_every_forced_path_round_trips_bit_exact(tmp_path, direct_io, inflight):
    _round_trip(str(tmp_path / "ckpt"), direct_io, inflight)


@pytest.mark.parametrize("direct_io,inflight", [(True, 4), (None, None), (False, 2)])
def test_tmpfs_round_trips_on_every_path_whether_it_takes_o_direct_or_not(direct_io, inflight):
    d = _shm_dir()
    try:
        _round_trip(os.path.join(d, "ckpt"), direct_io, inflight)
        liferaft.verify(os.path.join(d, "ckpt"))          # every block re-hashed, raises on a fault
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_split_requests_write_and_read_any_alignment_and_stop_at_the_end_of_file(tmp_path):
    from liferaft.staging.pool import page_aligned_empty

    st_ = PosixStorage(str(tmp_path / "r"), direct_io=True, inflight=4)
    src = page_aligned_empty(9 << 20)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    w = st_.open_writer("d.bin")
    w.pwrite(memoryview(src.numpy())[5:], 100)        # unaligned in the file and in memory
    w.pwrite(b"tail", 100 + src.numel() - 5)
    w.close()
    data = st_.read_all("d.bin")
    assert data[100:-4] == bytes(src.numpy())[5:] and data[-4:] == b"tail"
    for off in (0, 4096, 100):
        out = page_aligned_empty(16 << 20)            # longer than the file: parts beyond its end read nothing
        n = st_.read_into("d.bin", off, memoryview(out.numpy()))
        assert n == len(data) - off and bytes(out.numpy()[:n]) == data[off:]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_inflight_must_be_a_count(tmp_path, bad):
    with pytest.raises(OptionsError, match="inflight") as e:
        PosixStorage(str(tmp_path), inflight=bad)
    assert isinstance(e.value, LiferaftError)


def test_direct_io_must_be_a_bool_or_none(tmp_path):
    with pytest.raises(OptionsError, match="direct_io"):
        PosixStorage(str(tmp_path), direct_io="yes")  # type: ignore[arg-type]


def test_the_choice_is_kept_per_device(tmp_path):
    iopath.forget()
    try:
        a = iopath.choice_for(str(tmp_path))
        (tmp_path / "sub").mkdir()
        b = iopath.choice_for(str(tmp_path / "sub"))          # same device: no second probe
        assert a is b and len(iopath.probed()) == 1
    finally:
        iopath.forget()


# --- probes shared by the processes of a host (``HOST_DIR``) ------------------------------------------------------

_FIGURES = Probe(write={(True, 1): 2.0e9, (False, 4): 1.5e9}, read={(True, 1): 1.8e9, (False, 1): 2.1e9})


def test_a_shared_probe_round_trips():
    got = iopath.decode_probe(iopath.encode_probe(_FIGURES))
    assert got is not None and got.shared and got.write == _FIGURES.write and got.read == _FIGURES.read


@pytest.mark.parametrize("data", [
    b"", b"null", b"[]", b"not json", b'{"v": 2, "write": [], "read": []}', b'{"v": 1, "write": []}',
    b'{"v": 1, "write": [], "read": [[true, 1]]}',                       # short row
    b'{"v": 1, "write": [], "read": [[1, 1, 5.0]]}',                     # an int for the bool
    b'{"v": 1, "write": [], "read": [[true, true, 5.0]]}',               # a bool for the count
    b'{"v": 1, "write": [], "read": [[true, 3, 5.0]]}',                  # a count no probe measures
    b'{"v": 1, "write": [], "read": [[true, 1, -5.0]]}',
    b'{"v": 1, "write": [], "read": [[true, 1, NaN]]}',
    b'{"v": 1, "write": [], "read": [[true, 1, Infinity]]}',
    b'{"v": 1, "write": [], "read": [[true, 1, "5"]]}',
    b'{"v": 1, "write": [], "read": [[true, 1, 5.0], [true, 1, 6.0]]}',  # a path twice
    b'{"v": 1, "write": [], "read": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep (and too large)
    b'{"v": 1, "write": [], "read": [' + b",".join([b"[true, 1, 5.0]"] * 5) + b"]}",
])
def test_anything_but_a_well_formed_shared_probe_is_ignored(data):
    assert iopath.decode_probe(data) is None


def test_a_process_takes_the_probe_another_shared_instead_of_probing(tmp_path, monkeypatch):
    iopath.forget()
    try:
        first = iopath.choice_for(str(tmp_path))                        # probes, shares
        (dev, (_, figures)), = iopath.probed().items()
        assert not figures.shared and sorted(os.listdir(iopath.HOST_DIR)) == [
            f"liferaft-iopath-{os.getuid()}-{dev}-full.json", f"liferaft-iopath-{os.getuid()}-{dev}.lock"]
        iopath.forget()                                                 # as another process would start

        def no_probe(folder: str) -> Probe:
            raise AssertionError("probed again")
        monkeypatch.setattr(iopath, "probe", no_probe)
        monkeypatch.setattr(iopath, "probe_reads", no_probe)
        again = iopath.choice_for(str(tmp_path))
        assert again == first and iopath.probed()[dev][1].shared
        iopath.forget()
        data = tmp_path / "data.bin"
        data.write_bytes(b"\0" * (1 << 20))
        reading = iopath.choice_for(str(tmp_path), lambda: (lambda d: os.open(str(data), os.O_RDONLY), 1 << 20))
        assert reading == first                                         # a read takes a full probe too
    finally:
        iopath.forget()


@pytest.mark.parametrize("spoil", ["stale", "link", "foreign", "large", "fifo"])
def test_a_stale_linked_or_foreign_shared_probe_is_not_taken(tmp_path, monkeypatch, spoil):
    dev = os.stat(tmp_path).st_dev
    name = os.path.join(iopath.HOST_DIR, f"liferaft-iopath-{os.getuid()}-{dev}-full.json")
    good = iopath.encode_probe(_FIGURES)
    if spoil == "link":
        (tmp_path / "elsewhere.json").write_bytes(good)
        os.symlink(tmp_path / "elsewhere.json", name)
    elif spoil == "fifo":                                               # (an open that waits for a writer: a hang)
        os.mkfifo(name)
    else:
        with open(name, "wb") as f:
            f.write({"stale": good, "foreign": b'{"v": 1, "write": [[true, 1, 1e30]], "read": "x"}',
                     "large": good + b" " * 5000}[spoil])
        if spoil == "stale":
            old = time.time() - iopath.HOST_TTL - 60
            os.utime(name, (old, old))
    calls = []

    def counted(folder: str) -> Probe:
        calls.append(folder)
        return _FIGURES
    monkeypatch.setattr(iopath, "probe", counted)
    iopath.forget()
    try:
        done = threading.Thread(target=iopath.choice_for, args=(str(tmp_path),), daemon=True)
        done.start()
        done.join(60)
        assert not done.is_alive(), "waited on the shared-probe file"
        assert calls == [str(tmp_path)] and not iopath.probed()[dev][1].shared
        if spoil not in ("link", "fifo"):                              # replaced by the new figures
            assert iopath.decode_probe(open(name, "rb").read()) is not None
    finally:
        iopath.forget()


def test_processes_of_a_host_probe_once(tmp_path):
    script = ("import sys; from liferaft.storage import iopath; iopath.HOST_DIR = sys.argv[1]; "
              "iopath.choice_for(sys.argv[2]); (f,) = [p for _, p in iopath.probed().values()]; "
              "print(f.shared, f.seconds > 0)")
    share = tmp_path / "share"
    share.mkdir()
    outs = [subprocess.run([sys.executable, "-c", script, str(share), str(tmp_path)], capture_output=True,
                           text=True, timeout=120) for _ in range(2)]
    assert [o.stdout.split() for o in outs] == [["False", "True"], ["True", "False"]], [o.stderr for o in outs]
