"""Two real torchrun jobs (static rendezvous: TORCHELASTIC_RUN_ID=none) on one root: the second waits and is
refused, the first finishes untouched; an elastic restart of one job resumes as the same job at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from liferaft.manager.manager import list_steps
from liferaft.storage import resolve
from liferaft.testing.launcher import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_two_jobs_worker.py")


def _torchrun(root: str, ttl: float, mode: str, log: str, *extra: str) -> subprocess.Popen:
    """A 2-rank job on this host with static rendezvous (--master-addr/--master-port), its output in ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *extra, WORKER, root, str(ttl), mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"})


def _lines(root: str, word: str) -> list[list[str]]:
    """The worker's report lines (ROOT.report) starting with ``word``."""
    try:
        with open(root + ".report") as f:
            return [ln.split()[1:] for ln in f.read().splitlines() if ln.startswith(word + " ")]
    except FileNotFoundError:
        return []


def _wait(proc: subprocess.Popen, log: str, timeout: float = 120.0, until: Callable[[], bool] = lambda: False) -> str:
    """Wait for ``proc`` to end (killing it after ``timeout`` s or as soon as ``until()``); its output."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not until():
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with open(log) as f:
        return f.read()


def test_a_second_static_rendezvous_job_waits_and_is_refused(tmp_path):
    root = str(tmp_path / "run")
    ttl = 1.0
    a = _torchrun(root, ttl, "until-released", str(tmp_path / "a.log"))
    b = None
    try:
        deadline = time.monotonic() + 120
        while len(_lines(root, "JOB")) < 2:                          # job A holds the lease
            assert a.poll() is None and time.monotonic() < deadline, open(tmp_path / "a.log").read()[-3000:]
            time.sleep(0.1)
        b = _torchrun(root, ttl, "until-released", str(tmp_path / "b.log"))
        out_b = _wait(b, str(tmp_path / "b.log"), until=lambda: len(_lines(root, "JOB")) > 2)
        assert len(_lines(root, "JOB")) == 2, out_b[-3000:]           # B never got a manager ...
        assert b.returncode != 0, out_b[-3000:]
        assert "CheckpointBusyError" in out_b and "is in use" in out_b, out_b[-3000:]    # ... it was refused
        assert a.poll() is None, open(tmp_path / "a.log").read()[-3000:]     # A still runs ...
        open(root + ".release", "w").close()
        out_a = _wait(a, str(tmp_path / "a.log"))
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    assert a.returncode == 0, out_a[-3000:]                                 # ... and finishes every save
    jobs = {j for _, _, j, _ in _lines(root, "JOB")}
    assert len(jobs) == 1 and next(iter(jobs)).startswith(f"torchrun:{socket.gethostname()}:{a.pid}:"), jobs
    done = {int(last) for _, last in _lines(root, "DONE")}
    assert len(done) == 1
    steps = list_steps(resolve(root))
    assert [s.step for s in steps] == list(range(next(iter(done)) + 1))
    assert all(s.status == "committed" and s.job_id in jobs for s in steps), steps


def test_an_elastic_restart_resumes_as_the_same_job_at_once(tmp_path):
    root = str(tmp_path / "run")
    log = str(tmp_path / "job.log")
    proc = _torchrun(root, 30.0, "crash-once", log, "--max-restarts", "1")     # waiting would take 30 s
    out = _wait(proc, log)
    assert proc.returncode == 0, out[-3000:]
    jobs = _lines(root, "JOB")
    assert sorted((r, n) for r, n, _, _ in jobs) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], out[-3000:]
    ids = {j for _, _, j, _ in jobs}
    assert ids == {next(iter(ids))} and next(iter(ids)).startswith(f"torchrun:{socket.gethostname()}:{proc.pid}:")
    assert all(float(t) < 10.0 for r, n, _, t in jobs if n == "1"), jobs       # no wait for the old lease
    assert {int(s) for _, s in _lines(root, "DONE")} == {4}
    steps = list_steps(resolve(root))
    assert [(s.step, s.status) for s in steps] == [(i, "committed") for i in range(4)]
    assert {s.job_id for s in steps} == ids


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
