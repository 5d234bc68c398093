"""Elastic membership under real torchrun (``--nnodes 1:2``, c10d rendezvous): two agents on this host stand for two
nodes of one rank each; mid-training node b is lost whole (its agent, its worker and its shared memory), node a's
agent restarts its worker in a rendezvous of one node, and the job goes on at world size 1 from the replica of node
b's data that node a's memory tier holds: the newest memory save, newer than the root's, restored bit for bit.

What it checks beyond tests/multiproc/test_elastic.py (one agent, a worker killed): a world that shrinks under
torchrun's elastic membership (``liferaft.init_process_group``'s incarnation count with fewer ranks, the tier's node
list rebuilt with one node, a checkpoint saved by 2 ranks restored on 1), and a restore that needs the replica of a
node that is gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import torch

from liferaft.testing.launcher import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_nodes_worker.py")
KILL_AT = 13                # node b is lost after step 13: memory saves at 0, 4, 8, 12; root saves at 0 and 10
STEPS = 24
#: c10d rendezvous: a dead node is dropped 2 s after its last heartbeat; a round of 1 node (the minimum) closes
#: 1 s after it was reached, one of 2 (the maximum) at once
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,read_timeout=60"


def _agent(out: str, shm: str, port: int, node: str) -> subprocess.Popen:
    """Node ``node``'s torchrun agent (its own session); node a hosts the rendezvous's store (``is_host``), node b
    connects to it, so that b's loss leaves the store up. Output in OUT/<node>.log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-nodes-test",
           "--rdzv-conf", f"{RDZV_CONF},is_host={int(node == 'a')}", "--max-restarts", "2",
           "--monitor-interval", "0.1", WORKER, out, shm, str(KILL_AT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    with open(os.path.join(out, f"{node}.log"), "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", "LIFERAFT_TEST_NODE": node})


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
    return out


def _kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids``' process groups (each agent and each worker is a session leader)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _log(out: str) -> str:
    tails = []
    for node in "ab":
        with contextlib.suppress(OSError), open(os.path.join(out, f"{node}.log")) as f:
            tails.append(f"--- node {node} ---\n{f.read()[-3000:]}")
    return "\n".join(tails)


def test_a_lost_node_leaves_a_job_of_one_node_that_restores_its_replica_from_memory(tmp_path, shm):
    """Node b is lost after step 13 (memory saves every 4 steps, root saves every 10). Torchrun's agent on node a
    restarts its worker once, in a world of 1; the worker restores step 12 from node a's memory (which holds node
    b's replica; the root's newest is step 10), its parameters and optimizer state bitwise those of step 12 in the
    first incarnation, and trains to the end; agent a exits 0."""
    out = str(tmp_path)
    port = free_port()
    agents = {"a": _agent(out, shm, port, "a"), "b": _agent(out, shm, port, "b")}
    workers: list[int] = []
    try:
        try:
            rc = agents["a"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = "timed out"
        finally:
            workers = [c for p in agents.values() for c in _children(p.pid)]
        assert rc == 0, _log(out)
        assert agents["b"].wait(timeout=10) == -signal.SIGKILL, _log(out)      # killed by its own worker
        with open(os.path.join(out, "events.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    finally:
        _kill(workers + [p.pid for p in agents.values()])
    ups = [r for r in rows if r["event"] == "up"]
    first = sorted((r for r in ups if r["restart"] == 0), key=lambda r: r["rank"])
    assert [(r["node"], r["world"]) for r in sorted(first, key=lambda r: r["node"])] == [("a", 2), ("b", 2)], rows
    assert [r["rank"] for r in first] == [0, 1] and all(r["resumed"] is None for r in first), rows
    assert all(r["parent_is_torchrun"] for r in ups), rows          # os.getppid() is the agent: b's kill hit it
    (kill,) = [r for r in rows if r["event"] == "kill"]
    assert kill["node"] == "b" and kill["restart"] == 0, kill
    (again,) = [r for r in ups if r["restart"] > 0]                  # node a's worker, restarted once
    assert (again["node"], again["restart"], again["rank"], again["world"]) == ("a", 1, 0, 1), again
    assert again["nodes"] == ["a"], again
    assert again["held"] == ["r00000.bin", "r00001.bin"], again      # its own data and node b's replica
    # the newest memory save (step 12), not the root's newest (step 10), and all of it from node a's memory
    assert again["resumed"] == 12 and again["state_step"] == 13, again
    assert again["tier"]["step"] == 12 and again["tier"]["files_from_fallback"] == 0, again
    assert again["tier"]["files_from_peers"] == 0 and again["tier"]["bytes_from_peers"] == 0, again
    listed = {s: tuple(t) for s, t in again["steps"]}
    assert listed[12] == ("memory",) and max(s for s, t in listed.items() if "root" in t) == 10, listed
    assert not os.path.exists(os.path.join(shm, "elastic-nodes-test", "b")), "node b's memory came back"
    restored, ref = torch.load(os.path.join(out, "restored-1.pt")), torch.load(os.path.join(out, "ref-12.pt"))
    assert restored.pop("step") == 12 and restored.pop("state_step") == 13
    assert restored.keys() == ref.keys() and len(ref) == 4 + 4 * 3, sorted(ref)     # 4 params, 3 AdamW states each
    assert all(torch.equal(restored[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(restored[k], ref[k])]
    (end,) = [r for r in rows if r["event"] == "end"]
    assert (end["node"], end["restart"], end["final_step"]) == ("a", 1, STEPS), end
    print(f"kill -> restarted worker's first step: {end['first_step'] - kill['kill']:.2f} s (worker start "
          f"{again['start'] - kill['kill']:.2f} s, restored {again['ready'] - kill['kill']:.2f} s)")
