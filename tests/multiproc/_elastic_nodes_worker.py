"""A torchrun worker for tests/multiproc/test_elastic_nodes.py: one rank per simulated node of an elastic job
(``--nnodes 1:2``) that loses a whole node mid-training and goes on with the node left.

    LIFERAFT_TEST_NODE=a|b torchrun --nnodes 1:2 --nproc-per-node 1 ... _elastic_nodes_worker.py OUT SHM KILL_AT

``liferaft.init_process_group("gloo")``; a small MLP under DDP with AdamW, its data drawn from the checkpointed
random streams; a manager whose root is OUT/root (full saves every ``ROOT_EVERY`` steps, drained from memory) and a
memory tier under SHM named by the node (``MemoryTier(node=LIFERAFT_TEST_NODE, replicas=1)``, saves every
``MEM_EVERY`` steps). Trains steps 0..STEPS-1. In the first incarnation, at step KILL_AT both ranks wait for the
tier's save in flight (so that the newest memory save is complete and replicated on both nodes), then node b's
worker loses its node: it removes its node's memory (SHM/JOB/b) and kills its torchrun agent and itself with
SIGKILL. Node a's worker then fails its next collective and its agent restarts it in a rendezvous of one node.

Every incarnation's worker appends a row to OUT/events.jsonl (its node, rank, world size, restart count, the step
restored and the memory tier's ``last_restore``, the steps its manager lists, times); node a's worker of the first
incarnation writes its parameters and optimizer state after each memory save to OUT/ref-<step>.pt, and a restored
worker writes what it restored, before training on, to OUT/restored-<restart>.pt.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import torch

import liferaft

STEPS = 24
MEM_EVERY = 4
ROOT_EVERY = 10
JOB = "elastic-nodes-test"


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The parameters and the optimizer state as one flat dict of tensor copies (compared with torch.equal)."""
    flat = {f"p{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    flat.update({f"s{i}.{k}": torch.as_tensor(v).clone() for i, s in enumerate(opt.state.values())
                 for k, v in s.items()})
    return flat


def _event(out: str, row: dict) -> None:
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    out, shm, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    node = os.environ["LIFERAFT_TEST_NODE"]
    t_start = time.time()
    liferaft.init_process_group("gloo", timeout=60)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "rng": liferaft.RNGState(), "step": 0}
    tier = liferaft.MemoryTier(JOB, node=node, base=shm, replicas=1, timeout=60)
    mgr = liferaft.CheckpointManager(os.path.join(out, "root"), every_steps=ROOT_EVERY, async_save=False,
                                     tiers=liferaft.TierOptions(memory=tier, memory_every=MEM_EVERY),
                                     preemption=liferaft.PreemptionOptions(signals=()))
    resumed = mgr.restore(state)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().split(b"\0")
    row = {"node": node, "pid": os.getpid(), "rank": rank, "world": world, "restart": restart, "resumed": resumed,
           "tier": dict(tier.last_restore), "nodes": tier.nodes, "start": t_start, "ready": time.time(),
           "steps": [(i.step, list(i.tiers)) for i in mgr.steps()], "state_step": state["step"],
           "parent_is_torchrun": b"torch.distributed.run" in parent,
           "held": [] if resumed is None else sorted(os.path.basename(n) for n in tier.step_storage(resumed).list()
                                                     if n.endswith(".bin"))}
    _event(out, {**row, "event": "up"})
    if resumed is not None:
        torch.save({"step": resumed, "state_step": state["step"], **flat_state(model, opt)},
                   os.path.join(out, f"restored-{restart}.pt"))
    for step in range(state["step"], STEPS):
        x = torch.randn(16, 32)                      # from the checkpointed random streams
        loss = (model(x) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        mgr.maybe_save(step, state)
        if step == row["state_step"]:
            row["first_step"] = time.time()          # this incarnation's first step done
        if restart == 0 and node == "a" and step % MEM_EVERY == 0:
            torch.save(flat_state(model, opt), os.path.join(out, f"ref-{step}.pt"))
        if restart == 0 and step == kill_at:
            tier.wait()                              # the memory save in flight: complete on both nodes
            torch.distributed.barrier()
            if node == "b":                          # node b is lost: its memory, its agent, its worker
                shutil.rmtree(os.path.join(shm, JOB, node))
                _event(out, {**row, "event": "kill", "kill": time.time()})
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    _event(out, {**row, "event": "end", "end": time.time(), "final_step": state["step"]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
