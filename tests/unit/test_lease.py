"""The root's lease (``liferaft.manager.lease``): who may take it over from whom. Holders are real processes
(a live one, a killed one, a live pid whose start time says it is not the holder); holders on another host are
lease records naming that host, as a job there would write them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import liferaft
from liferaft import CheckpointBusyError
from liferaft.manager.identity import machine_key, process_start
from liferaft.manager.lease import LEASE, Lease
from liferaft.storage import resolve

# (the liferaft package without its __init__, which imports torch: the holder starts in a blink)
HOLD = (f"import sys, types; p = types.ModuleType('liferaft'); p.__path__ = [{os.path.dirname(liferaft.__file__)!r}]; "
        "sys.modules['liferaft'] = p;"
        "from liferaft.manager.lease import Lease; from liferaft.storage import resolve;"
        "lease = Lease(resolve(sys.argv[1]), sys.argv[2], ttl=float(sys.argv[3])); lease.acquire();"
        "print('held', flush=True); sys.stdin.read()")


def _holder(root: str, job: str, ttl: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, root, job, str(ttl)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _record(root: str, **fields) -> None:
    os.makedirs(root, exist_ok=True)
    rec = {"job_id": "other", "host": socket.gethostname(), "pid": 1, "renewed_unix": time.time(), "token": "t",
           "started": None, "machine": machine_key(), "ttl": 60.0, **fields}
    with open(os.path.join(root, LEASE + ".tmp"), "w") as f:
        json.dump(rec, f)
    os.replace(os.path.join(root, LEASE + ".tmp"), os.path.join(root, LEASE))      # readers see all or nothing


def _take(root: str, job: str, ttl: float = 60.0) -> float:
    """Acquire (and release) the lease of ``job``; the seconds it took."""
    lease = Lease(resolve(root), job, ttl)
    t0 = time.monotonic()
    lease.acquire()
    took = time.monotonic() - t0
    lease.release()
    return took


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_a_live_holder_on_this_host_is_never_taken_over_whatever_its_job_id(tmp_path):
    live_root, dead_root = str(tmp_path / "live"), str(tmp_path / "dead")
    live = _holder(live_root, "job-x", 1.0)           # renews every 0.33 s
    dead = _holder(dead_root, "job-x", 60.0)
    try:
        assert live.stdout.readline().strip() == "held" and dead.stdout.readline().strip() == "held"
        # the same job id (a second launch given the same job_id) waits for the holder's ttl, then is refused
        t0 = time.monotonic()
        with pytest.raises(CheckpointBusyError, match=rf"another live process of job 'job-x' on this host "
                                                      rf"\(pid {live.pid}\)"):
            _take(live_root, "job-x", ttl=1.0)
        assert 1.0 <= time.monotonic() - t0 < 10
        assert live.poll() is None
        # a holder killed on this host is gone: its lease is taken at once (its ttl is 60 s)
        dead.kill()
        dead.wait()
        assert _take(dead_root, "job-y") < 5.0
    finally:
        for p in (live, dead):
            p.kill()
            p.wait()
    # a holder that exited without releasing: the same
    assert _take(live_root, "job-z") < 5.0


def test_a_reused_pid_is_not_the_holder(tmp_path, sleeper):
    if process_start(sleeper.pid) is None:
        pytest.skip("needs Linux /proc")
    root = str(tmp_path / "run")
    # the recorded holder had this pid but started at another time: it is dead, the pid belongs to another process
    _record(root, pid=sleeper.pid, started=process_start(sleeper.pid) + 1)
    assert _take(root, "job-y") < 5.0


def test_the_same_process_and_job_takes_its_own_lease_back(tmp_path):
    root = str(tmp_path / "run")
    first = Lease(resolve(root), "job-a", 60.0)
    first.acquire()
    try:
        assert _take(root, "job-a") < 5.0              # a manager re-created without close()
        with pytest.raises(CheckpointBusyError, match="lost its lease"):
            first.check()
    finally:
        first.release()


def test_a_holder_on_another_host(tmp_path, sleeper):
    root = str(tmp_path / "run")
    # the same job restarting with its rank 0 on this host now: taken at once
    _record(root, host="elsewhere", machine="boot/pid:[1]", job_id="job-r", pid=sleeper.pid)
    assert _take(root, "job-r") < 5.0
    # same host name, another kernel or pid namespace (a container): pids say nothing; the job id decides
    _record(root, machine="another-boot/pid:[4026531836]", job_id="job-r", pid=sleeper.pid)
    assert _take(root, "job-r") < 5.0
    # another job renewing there: refused after the holder's ttl, naming it
    stop, written = threading.Event(), threading.Event()

    def renew() -> None:
        while not stop.is_set():
            _record(root, host="elsewhere", machine="boot/pid:[1]", job_id="job-s", pid=77, ttl=0.6)
            written.set()
            stop.wait(0.1)

    t = threading.Thread(target=renew)
    t.start()
    try:
        written.wait()
        t0 = time.monotonic()
        with pytest.raises(CheckpointBusyError, match=r"job 'job-s' holds it \(host elsewhere, pid 77"):
            _take(root, "job-t", ttl=60.0)
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        t.join()


def test_stale_means_not_renewed_for_the_holders_ttl(tmp_path):
    root = str(tmp_path / "run")
    _record(root, host="elsewhere", machine="boot/pid:[1]", renewed_unix=time.time() - 30, ttl=1.0)
    assert _take(root, "job-n", ttl=60.0) < 2.0
    # a holder with a 3 s ttl, renewed 1.5 s ago, is live for a newcomer with a 0.5 s ttl: it waits for staleness
    _record(root, host="elsewhere", machine="boot/pid:[1]", renewed_unix=time.time() - 1.5, ttl=3.0)
    took = _take(root, "job-n", ttl=0.5)
    assert 1.0 <= took < 5.0


def test_an_old_lease_without_process_facts_still_counts(tmp_path, sleeper):
    root = str(tmp_path / "run")
    os.makedirs(root)
    with open(os.path.join(root, LEASE), "w") as f:          # as liferaft wrote it before: no started/machine/ttl
        json.dump({"job_id": "old", "host": socket.gethostname(), "pid": sleeper.pid, "renewed_unix": time.time() - 20,
                   "token": "t"}, f)
    assert _take(root, "new", ttl=10.0) < 5.0                 # stale by the newcomer's ttl
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    with open(os.path.join(root, LEASE), "w") as f:
        json.dump({"job_id": "old", "host": socket.gethostname(), "pid": sleeper.pid, "renewed_unix": time.time(),
                   "token": "t"}, f)
    assert _take(root, "new", ttl=10.0) < 5.0                 # its process is gone


def test_a_crafted_ttl_bounds_the_wait_and_is_refused_not_taken(tmp_path):
    # another host's lease claiming a ttl of 1e12 s (or infinity): the newcomer waits at most its bound, then
    # refuses; it never waits for ever and never takes over a lease whose holder may still be renewing it
    for ttl in (1e12, float("inf"), float("nan"), -5.0):
        root = str(tmp_path / f"r{ttl}")
        _record(root, host="elsewhere", machine="", ttl=ttl)
        lease = Lease(resolve(root), "me", ttl=0.5, max_wait=1.5)
        t0 = time.monotonic()
        if ttl == 1e12:
            with pytest.raises(CheckpointBusyError, match="in use"):
                lease.acquire()
            assert time.monotonic() - t0 < 10
        else:                        # not a ttl at all: the newcomer's own (0.5 s) applies; unchanged → stale
            lease.acquire()
            assert time.monotonic() - t0 < 10
            lease.release()


def test_a_lease_renewed_in_the_future_goes_stale_when_it_stops_changing(tmp_path):
    # a clock skewed (or crafted) far ahead: judged by whether the lease changes while the newcomer watches
    root = str(tmp_path / "r")
    _record(root, host="elsewhere", machine="", ttl=1.0, renewed_unix=time.time() + 10 ** 6)
    lease = Lease(resolve(root), "me", ttl=1.0, max_wait=5.0)
    t0 = time.monotonic()
    lease.acquire()
    assert 1.0 < time.monotonic() - t0 < 10
    lease.release()


def test_non_finite_renewal_times_are_a_damaged_lease(tmp_path):
    root = str(tmp_path / "r")
    os.makedirs(root)
    with open(os.path.join(root, LEASE), "w") as f:
        f.write('{"job_id": "x", "host": "elsewhere", "pid": 5, "renewed_unix": Infinity, "ttl": 60}')
    lease = Lease(resolve(root), "me", ttl=1.0)
    t0 = time.monotonic()
    lease.acquire()                      # damaged: protects nothing (as any unreadable lease)
    assert time.monotonic() - t0 < 5
    lease.release()


def test_a_lease_from_the_future_is_refused_saying_how_to_clear_it(tmp_path):
    root = str(tmp_path / "r")
    _record(root, host="elsewhere", machine="", ttl=1e9, renewed_unix=1e12)
    lease = Lease(resolve(root), "me", ttl=0.5, max_wait=1.0)
    with pytest.raises(CheckpointBusyError, match="in the future .* delete .*LEASE"):
        lease.acquire()


def test_a_holder_stalled_past_its_ttl_fences_itself(tmp_path):
    """A holder whose last renewal began a ttl or more ago (its process stopped or starved that long: a newcomer
    may be taking the root over right now) takes its lease as lost although the file still names it: ``check``
    (every commit and step deletion) refuses, and its renewal thread never writes the lease again, so a newcomer
    that waited for it to go stale holds the root alone (helper-114: a holder stopped between its renewal's read and
    its write replaced the newcomer's lease, and the newcomer's saves stopped while the stale job's went on)."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    a = Lease(resolve(root), "A", ttl=1.0)
    a.acquire()
    try:
        a.check()
        assert a._written is not None
        a._written -= 1.5                   # (its last renewal began 1.5 s ago: stalled past the ttl)
        with pytest.raises(CheckpointBusyError, match="not renewed for"):
            a.check()
        b = Lease(resolve(root), "B", ttl=1.0)
        b.acquire()                         # (waits until A's lease, no longer renewed, is stale)
        try:
            time.sleep(1.2)                 # (A's renewal thread ran meanwhile)
            b.check()
            with open(os.path.join(root, LEASE)) as f:
                assert json.load(f)["job_id"] == "B"
            with pytest.raises(CheckpointBusyError):
                a.check()
        finally:
            b.release()
    finally:
        a.release()
