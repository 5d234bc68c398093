"""Elastic restarts under real torchrun: a worker killed with SIGKILL mid-training, torchrun restarts both workers
(``--max-restarts 1``), the manager restores from the nodes' memory (and the per-step log), and the run ends bitwise
equal to one never interrupted. The job's process group comes from ``liferaft.init_process_group`` (without it the
restarted workers' gloo group hangs on the previous incarnation's keys, pytorch/pytorch#135712)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_worker.py")


def _run(tmp_path, name: str, mode: str, kill_at: int) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    out = str(tmp_path / name)
    shm = str(tmp_path / f"{name}-shm")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", WORKER, out, shm, mode, str(kill_at)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    with open(out + ".jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows, torch.load(out + ".pt"), log


@pytest.mark.parametrize("mode", ["per-step", "memory"])
def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_from_memory(tmp_path, mode):
    kill_at = 24
    whole_rows, whole, _ = _run(tmp_path, "whole", mode, -1)
    assert [r["restart"] for r in whole_rows] == [0] and whole_rows[0]["resumed"] is None
    rows, killed, log = _run(tmp_path, "killed", mode, kill_at)
    assert [r["restart"] for r in rows] == [0, 1], log[-4000:]        # torchrun restarted the workers once
    if mode == "per-step":                      # the step killed after: the full save from memory + the records
        assert rows[1]["resumed"] == kill_at, rows
        assert rows[1]["full"] + rows[1]["replayed"] == kill_at and rows[1]["replayed"] >= 1, rows
    else:                                       # the newest full save in memory (every 10 steps)
        assert kill_at - 10 < rows[1]["resumed"] <= kill_at, rows
    assert whole.keys() == killed.keys()
    assert all(torch.equal(whole[k], killed[k]) for k in whole), [k for k in whole if not torch.equal(whole[k],
                                                                                                  killed[k])]


def test_init_process_group_outside_torchrun_is_torchs(tmp_path):
    """Without torchrun's variables it is torch's env:// call (here a world of one)."""
    code = ("import liferaft, torch.distributed as d; liferaft.init_process_group('gloo'); "
            "print(d.get_world_size(), d.get_rank()); d.destroy_process_group()")
    from liferaft.testing.launcher import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["1", "0"], out.stderr[-2000:]
