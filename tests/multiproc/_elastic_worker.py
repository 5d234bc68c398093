"""A torchrun worker for tests/multiproc/test_elastic.py: a 2-rank DDP job that torchrun restarts after a kill -9.

    torchrun --max-restarts 1 ... _elastic_worker.py OUT SHM MODE KILL_AT

``liferaft.init_process_group("gloo")``; a small MLP under DDP with AdamW, its data drawn from the checkpointed random
streams; a manager with a memory tier under SHM (full saves every 10 steps) and, in MODE "per-step", the per-step
log. Trains steps 0..39; in the first incarnation rank 1 kills itself with SIGKILL right after step KILL_AT's
``maybe_save`` (KILL_AT < 0: never). Each incarnation's rank 0 appends ``{"restart", "resumed", "recovery"}`` to
OUT.jsonl; at the end rank 0 writes the parameters and optimizer state to OUT.pt.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import liferaft

STEPS = 40


def main() -> None:
    out, shm, mode, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    liferaft.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "rng": liferaft.RNGState(), "step": 0}
    tier = liferaft.MemoryTier("elastic-test", node=f"node{rank}", base=shm, replicas=1)
    extra = {"step_log": liferaft.StepLogOptions(replicas=1, max_steps=16)} if mode == "per-step" else {}
    mgr = liferaft.CheckpointManager(out + ".root", every_steps=10, async_save=False,
                                     tiers=liferaft.TierOptions(memory=tier, memory_every=10),
                                     preemption=liferaft.PreemptionOptions(signals=()), **extra)
    start = mgr.restore(state)
    if rank == 0:
        rec = getattr(getattr(mgr, "_steplog", None), "last_recovery", None) or {}
        with open(out + ".jsonl", "a") as f:
            f.write(json.dumps({"restart": restart, "resumed": start, "replayed": rec.get("replayed"),
                                "full": rec.get("full")}) + "\n")
    for step in range(state["step"], STEPS):
        x = torch.randn(16, 32)                      # from the checkpointed random streams
        loss = (model(x) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        mgr.maybe_save(step, state)
        if restart == 0 and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    if rank == 0:
        flat = {f"p{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
        flat.update({f"s{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()})
        torch.save(flat, out + ".pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
