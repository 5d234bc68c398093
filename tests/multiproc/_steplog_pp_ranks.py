"""Ranks of the per-step log's pipeline-like layout test: 2 nodes × 2 ranks, local position p = rank % 2 holds
stage p (different parameters per stage), data parallel across nodes (ranks of the same stage have the same
gradients, as after a DP all-reduce). Drives ``StepLog`` directly, without full checkpoints: ``recover(full=0)``
replays onto the state after step 0, which every run rebuilds deterministically."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from liferaft import MemoryTier
from liferaft.tiers.steplog import StepLog

SIZES = {0: (8, 16), 1: (64, 64)}       # stage 1's records longer than stage 0's


def build(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    i, o = SIZES[rank % 2]
    model = nn.Linear(i, o)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def step_fn(st: dict[str, Any], rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + rank % 2)     # the same on both DP replicas of a stage
    for p in st["model"].parameters():
        p.grad = torch.randn(p.shape, generator=g)
    st["optim"].step()
    st["optim"].zero_grad()


def snap(st: dict[str, Any]) -> dict[str, bytes]:
    out = {k: v.detach().clone().numpy().tobytes() for k, v in st["model"].state_dict().items()}
    out.update({f"m{i}": s["momentum_buffer"].numpy().tobytes() for i, s in enumerate(st["optim"].state.values())})
    return out


def job(rank: int, world: int, base: str, last: int, recover: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    st = build(rank)
    step_fn(st, rank, 0)            # the "full checkpoint" the records replay onto
    log = StepLog(MemoryTier("pp", node=f"n{rank // 2}", base=base, timeout=20), replicas=1, max_steps=8,
                  timeout=20)
    out: dict[str, Any] = {"after0": snap(st)}
    start = 0
    if recover:
        start = log.recover(st, 0)
        out["recovery"] = {k: v for k, v in log.last_recovery.items() if k != "timings"}
        out["state_at_start"] = snap(st)
    else:
        log.attach(st)
    for s in range(start + 1, last + 1):
        step_fn(st, rank, s)
        log.record(s, st)
        out[f"after{s}"] = snap(st)
    log.close()
    return out
