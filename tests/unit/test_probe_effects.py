"""Side effects of the I/O probe (``storage/iopath.py``): its file has no name where the file system allows
(a kill -9 mid-probe leaves nothing); a named probe file left elsewhere is never taken for data and cleanup
removes it; reading an existing checkpoint never writes into it (only read paths are probed, on its data);
the processes of a host probing one folder take turns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import liferaft
from liferaft import CheckpointManager, PreemptionOptions
from liferaft.format.layout import PROBE_PREFIX, is_layout_name, is_probe_name, is_stale, step_name
from liferaft.storage import PosixStorage, iopath

NO_SIGNALS = PreemptionOptions(signals=())
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True)


def test_probe_file_has_no_name_where_the_file_system_allows(tmp_path):
    fd, name = iopath._probe_file(str(tmp_path))
    try:
        if name is None:
            assert os.listdir(tmp_path) == []          # O_TMPFILE: nothing to see while it is in use
        else:
            assert is_probe_name(os.path.basename(name))
    finally:
        os.close(fd)
        if name:
            os.unlink(name)


def test_kill_9_during_the_probe_leaves_nothing_a_reader_takes_for_data(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    child = _child("import sys\nfrom liferaft.storage import iopath\nprint('go', flush=True)\n"
                   "while True:\n    iopath.probe(sys.argv[1])\n", str(folder))
    assert child.stdout is not None and child.stdout.readline() == "go\n"
    time.sleep(0.5)                                        # somewhere inside a probe
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = os.listdir(folder)
    assert all(is_probe_name(n) for n in left)           # none at all on ext4/xfs/tmpfs (O_TMPFILE)
    assert all(is_layout_name(n) and is_stale(n, "x") for n in left)


def test_named_probe_leftovers_are_not_data_and_cleanup_removes_them(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, async_save=False, preemption=NO_SIGNALS)
    mgr.save(1, {"w": torch.arange(10.0)})
    mgr.close()
    stray = [os.path.join(root, PROBE_PREFIX + "aaaa"), os.path.join(root, step_name(1), PROBE_PREFIX + "bbbb")]
    os.makedirs(os.path.join(root, step_name(2)))                  # a save killed while probing its folder
    stray.append(os.path.join(root, step_name(2), PROBE_PREFIX + "cccc"))
    for p in stray:
        with open(p, "wb") as f:
            f.write(b"\x5a" * 4096)
    out = {"w": torch.zeros(10)}
    liferaft.load(os.path.join(root, step_name(1)), out)            # a committed step with a probe file loads
    assert torch.equal(out["w"], torch.arange(10.0))
    assert liferaft.verify(os.path.join(root, step_name(1))).chunks >= 1    # raises if not
    mgr = CheckpointManager(root, async_save=False, preemption=NO_SIGNALS)     # cleanup at start (behind)
    try:
        mgr.steps()                                                                 # (waits for it)
        assert not any(os.path.exists(p) for p in stray)
        assert not os.path.exists(os.path.join(root, step_name(2)))            # not kept as someone's folder
        out = {"w": torch.zeros(10)}
        assert mgr.restore(out) == 1 and torch.equal(out["w"], torch.arange(10.0))
    finally:
        mgr.close()


def _big_checkpoint(path: str) -> dict[str, torch.Tensor]:
    state = {"big": torch.randn((iopath.PROBE_FROM * 2) // 4), "small": torch.arange(7.0)}
    liferaft.save(PosixStorage(path, direct_io=True, inflight=1), state)   # forced: no probe while saving
    return state


@pytest.mark.parametrize("how", ["load", "read", "verify"])
def test_reading_a_checkpoint_probes_reads_only_and_writes_nothing(tmp_path, how):
    path = str(tmp_path / "ck")
    state = _big_checkpoint(path)
    before = sorted(os.listdir(path)), os.stat(path).st_mtime_ns
    iopath.forget()
    try:
        if how == "load":
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            liferaft.load(path, out)
            assert all(torch.equal(out[k], v) for k, v in state.items())
        elif how == "read":
            got = liferaft.read(path)
            assert all(torch.equal(got[k], v) for k, v in state.items())
        else:
            assert liferaft.verify(path).bytes_checked >= state["big"].numel() * 4
        dev = os.stat(path).st_dev
        probed = iopath.probed()
        if dev in probed:                                  # (a read below PROBE_FROM does not probe at all)
            assert probed[dev][1].write == {}             # no write was timed: nothing was written
        assert (sorted(os.listdir(path)), os.stat(path).st_mtime_ns) == before
    finally:
        iopath.forget()


def test_a_save_after_a_read_only_probe_measures_writes_too(tmp_path):
    path = str(tmp_path / "ck")
    state = _big_checkpoint(path)
    iopath.forget()
    try:
        liferaft.load(path, {k: torch.zeros_like(v) for k, v in state.items()})
        liferaft.save(str(tmp_path / "ck2"), {"w": torch.randn(16 << 20)})     # 64 MiB: large writes
        (choice, figures), = iopath.probed().values()
        assert figures.write                               # the save probed its device in full
    finally:
        iopath.forget()


def test_processes_probing_one_folder_take_turns(tmp_path):
    import fcntl

    from liferaft.storage import iopath

    folder = str(tmp_path)
    lock = os.path.join(iopath.HOST_DIR, f"liferaft-iopath-{os.getuid()}-{os.stat(folder).st_dev}.lock")
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o600)     # (the device's lock file: not the folder, which a
    fcntl.flock(fd, fcntl.LOCK_EX)                         # save holds) as if another rank of this host probed
    try:
        child = _child("import sys\nfrom liferaft.storage import iopath\niopath.HOST_DIR = sys.argv[2]\n"
                       "print('go', flush=True)\niopath.choice_for(sys.argv[1])\nprint('done', flush=True)\n",
                       folder, iopath.HOST_DIR)
        assert child.stdout is not None and child.stdout.readline() == "go\n"
        time.sleep(1.0)                                    # a free probe ends well within this
        assert child.poll() is None                        # still waiting for its turn
    finally:
        os.close(fd)                                       # our turn ends
    assert child.stdout.readline() == "done\n"
    assert child.wait(timeout=60) == 0


_FSIZE_PROBE = """
import os, resource, signal, sys
from liferaft.storage import iopath
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a write past the limit fails with EFBIG instead
limit = int(sys.argv[2]) << 20
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
before = len(os.listdir("/proc/self/fd"))
try:
    p = iopath.probe(sys.argv[1])
    print("ok", len(p.write), len(p.read), min(p.read.values(), default=0) > 0)
except OSError as e:
    print("oserror", e.errno)
print("fds", len(os.listdir("/proc/self/fd")) - before)
"""


@pytest.mark.parametrize("limit_mib, want", [(40, "ok"), (24, "ok"), (8, "oserror")])
def test_a_probe_short_of_room_times_what_fits_and_leaves_nothing_open(tmp_path, limit_mib, want):
    # RLIMIT_FSIZE stands in for a file system short of room (EFBIG where ENOSPC would come): the 48 MiB read
    # file is cut short (its reads timed on what fits), or the 16 MiB writes fail (an OSError: the device keeps
    # the default path); either way the probe file is closed and gone, and no BufferError escapes
    out = subprocess.run([sys.executable, "-c", _FSIZE_PROBE, str(tmp_path), str(limit_mib)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == want, out.stdout
    if want == "ok":
        assert lines[1:4] == ["4", "4", "True"], out.stdout
    assert out.stdout.strip().endswith("fds 0"), out.stdout
    assert os.listdir(tmp_path) == []
