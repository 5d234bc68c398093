"""Rank bodies for test_steplog_replay.py: a per-step log whose replay fails on one rank alone, after every check
passed (a user object refusing, in its ``load_state_dict``, a value of the last record's rest of the state)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import liferaft
from liferaft import CheckpointManager, JobOptions, MemoryTier, StepLogOptions, TierOptions
from liferaft.errors import CorruptCheckpointError


class _Count:
    """A stateful object that refuses, on ``refuse_on`` alone, the count ``refused`` (a rank's own view)."""

    def __init__(self, rank: int, refuse_on: int, refused: int) -> None:
        self.n, self.rank, self.refuse_on, self.refused = 0, rank, refuse_on, refused

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        if self.rank == self.refuse_on and sd["n"] == self.refused:
            raise ValueError(f"rank {self.rank} refuses a count of {sd['n']}")
        self.n = sd["n"]


def _build(rank: int, refuse_on: int, refused: int) -> dict:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "count": _Count(rank, refuse_on, refused)}


def _step(st: dict, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    st["model"](torch.randn(3, 4, generator=g)).pow(2).mean().backward()
    st["optim"].step()
    st["optim"].zero_grad()
    st["count"].n += 1


def _manager(rank: int, root: str, base: str) -> CheckpointManager:
    tier = MemoryTier("replay", node=f"node{rank}", base=base, timeout=30)
    return CheckpointManager(root, every_steps=4, tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                             step_log=StepLogOptions(replicas=1, max_steps=16),
                             job=JobOptions(job_id="replay", lease_ttl=5.0), async_save=False,
                             save_options=liferaft.SaveOptions(timeout=30))


def _tensors(st: dict) -> list[bytes]:
    out = [p.detach().numpy().tobytes() for p in st["model"].parameters()]
    return out + [v.numpy().tobytes() for s in st["optim"].state.values() for v in s.values() if torch.is_tensor(v)]


def replay_fails_on_one_rank(rank: int, world: int, root: str, base: str, refuse_on: int, last: int) -> dict:
    """Train to ``last`` (full checkpoint at 4, records after it), then restore: rank ``refuse_on``'s load of the
    last record's rest fails; then restore into a state made anew. What each rank saw, and its tensors at the
    step the second restore reached (and at that step of the training)."""
    warnings.simplefilter("ignore")
    out: dict = {}
    st, mgr = _build(rank, -1, -1), _manager(rank, root, base)
    for step in range(last + 1):
        _step(st, rank, step)
        mgr.maybe_save(step, st)
        if step == last - 1:
            out["trained"] = _tensors(st)
    mgr.close()
    mgr = _manager(rank, root, base)
    try:
        out["first"] = mgr.restore(_build(rank, refuse_on, last + 1))      # (the count after step `last`)
    except CorruptCheckpointError as e:
        out["first"] = str(e)
    st = _build(rank, refuse_on, last + 1)
    out["second"] = mgr.restore(st)
    out["restored"] = _tensors(st)
    out["count"] = st["count"].n
    mgr.close()
    return out
