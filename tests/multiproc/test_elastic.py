"""Elastic restarts under real torchrun: a worker killed with SIGKILL mid-training, torchrun restarts both workers
(``--max-restarts 1``), the manager restores from the nodes' memory (and the per-step log), and the run ends bitwise
equal to one never interrupted. The job's process group comes from ``liferaft.init_process_group`` (without it the
restarted workers' gloo group hangs on the previous incarnation's keys, pytorch/pytorch#135712)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run never interrupted, once for both modes (a mode changes what is saved, never what is trained: the
    per-step mode's run ends equal to it too, which the test then also shows)."""
    rows, state, _ = _run(tmp_path_factory.mktemp("whole"), "whole", "memory", -1)
    assert [r["restart"] for r in rows] == [0] and rows[0]["resumed"] is None
    return state


@pytest.mark.parametrize("mode", ["per-step", "memory"])
def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_from_memory(tmp_path, mode, whole):
    kill_at = 24
    rows, killed, log = _run(tmp_path, "killed", mode, kill_at)
    assert [r["restart"] for r in rows] == [0, 1], log[-4000:]        # torchrun restarted the workers once
    assert rows[0]["resumed"] is None, rows                         # (the first start found nothing to resume)
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


_MEET = """
import sys, torch, torch.distributed as d, liferaft
liferaft.init_process_group("gloo", timeout=60)
t = torch.ones(1) * (d.get_rank() + 1)
d.all_reduce(t)
print(d.get_world_size(), int(t.item()), flush=True)
d.barrier()                      # (every rank past its last collective before any tears its connections down)
d.destroy_process_group()
"""


def test_incarnations_meet_whatever_the_agents_count_and_the_world_was_before():
    """torchrun counts restarts per node's agent (a node that restarts its workers for a membership change, or a
    replacement node, counts otherwise) and the store keeps what earlier workers wrote: incarnations of a job on one
    store, with worlds 2 → 1 → 2 (a node lost, then back) → 3, restart counts that disagree, and a worker that died
    before it joined in between (its nonce left in the store), each meet (a per-rank counter of incarnations put
    the regrown world's ranks on different keys: a hang until the timeout)."""
    import datetime

    import torch.distributed as dist

    from liferaft.testing.launcher import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))          # (torchrun's agent store, kept)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}

    def start(code: str, r: int, world: int, count: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**base, "RANK": str(r), "WORLD_SIZE": str(world),
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                                "TORCHELASTIC_RESTART_COUNT": count,
                                                "TORCHELASTIC_USE_AGENT_STORE": "True"})

    for world, counts in ((2, "00"), (1, "1"), (2, "20"), ("dies", "3"), (3, "301")):
        if world == "dies":         # rank 1 of a world of 2 alone: it says hello, then is killed waiting
            lone = start(_MEET.replace("timeout=60", "timeout=30"), 1, 2, counts)
            time.sleep(4.0)
            lone.kill()
            lone.communicate()
            continue
        procs = [start(_MEET, r, world, counts[r]) for r in range(world)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * world, (world, [o[1][-2000:] for o in outs])
        total = world * (world + 1) // 2
        assert [o[0].split() for o in outs] == [[str(world), str(total)]] * world, outs
    del agent


def test_init_process_group_under_torchrun_needs_its_variables():
    code = "import liferaft; liferaft.init_process_group('gloo')"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "RANK", "WORLD_SIZE"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "TORCHELASTIC_RESTART_COUNT": "0"})
    assert out.returncode != 0 and "OptionsError" in out.stderr and "RANK" in out.stderr, out.stderr[-2000:]
