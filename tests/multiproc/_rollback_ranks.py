"""Rank functions for the rollback tests (``multiproc._rollback_ranks``): a CheckpointManager with a memory tier on
simulated nodes (each its own namespace), whose states say which run they belong to."""

from __future__ import annotations

from typing import Any

import torch
from multiproc._crash_ranks import state_at

from liferaft import CheckpointManager, JobOptions, TierOptions
from liferaft.tiers.memory import MemoryTier


def state(rank: int, world: int, step: int, run: int) -> dict[str, Any]:
    s = state_at(rank, world, step)
    s["run"] = torch.full((3,), float(run))
    return s


def _manager(root: str, tier: MemoryTier, memory_every: int) -> CheckpointManager:
    return CheckpointManager(root, every_steps=10, async_save=False, tiers=TierOptions(tier, memory_every=memory_every,
                                                                                        drain=False),
                             job=JobOptions(job_id="rollback-job", lease_ttl=5.0))


def run(rank: int, world: int, base: str, root: str, nodes: list[str], run: int, back_to: int | None,
        last: int) -> dict[str, Any]:
    """Restore (``back_to``: exactly that step, a rollback), then save steps up to ``last``: memory every step, the
    root every 10. Returns the step restored, the run its state belongs to, and the memory tier's steps after."""
    tier = MemoryTier("rollback", node=nodes[rank], base=base, keep=1)
    s = state(rank, world, -1, -1)
    with _manager(root, tier, 1) as mgr:
        start = mgr.restore(s, step=back_to)
        out = {"restored": start, "run": int(s["run"][0].item())}
        for step in range(0 if start is None else start + 1, last + 1):
            mgr.maybe_save(step, state(rank, world, step, run))
            tier.wait()
        out["memory"] = tier.local_steps()
    return out


def pinned(rank: int, world: int, base: str, root: str, nodes: list[str]) -> dict[str, Any]:
    """Steps 0..25 (root 0 10 20, memory every 5 steps, no replicas), 20 pinned; restore(step=10), then a save:
    refused on every rank, nothing removed anywhere."""
    from liferaft.errors import CheckpointExistsError

    tier = MemoryTier("rollback", node=nodes[rank], base=base, replicas=0, keep=1)
    with _manager(root, tier, 5) as mgr:
        for step in range(26):
            mgr.maybe_save(step, state(rank, world, step, 1))
            tier.wait()
        mgr.pin(20)
        out: dict[str, Any] = {"memory_before": tier.local_steps()}
        mgr.restore(state(rank, world, -1, -1), step=10)
        try:
            mgr.maybe_save(11, state(rank, world, 11, 2))
        except CheckpointExistsError as e:
            out["raised"] = str(e)
        out["memory_after"] = tier.local_steps()
        out["root_after"] = [i.step for i in mgr.steps() if "root" in i.tiers]
        out["again"] = mgr.restore(state(rank, world, -1, -1))
    return out
