"""Rank functions for tests/multiproc/test_parity_tier.py (imported as ``multiproc._parity_ranks``): ranks grouped
into simulated nodes, each its own shared-memory namespace, with a memory tier keeping XOR parity across nodes."""

from __future__ import annotations

import os

from multiproc._crash_ranks import _equal, state_at

from liferaft.tiers.memory import MemoryTier


def node_of(rank: int, per_node: int) -> str:
    return f"n{rank // per_node}"


def save(rank: int, world: int, base: str, per_node: int, parity: int, last: int) -> dict[str, int]:
    """Save steps 0..``last`` into the tier; this rank's bytes of data and of parity (the newest step)."""
    tier = MemoryTier("parity-test", node=node_of(rank, per_node), base=base, parity=parity)
    for step in range(last + 1):
        tier.save(step, state_at(rank, world, step))
    tier.wait()
    step_dir = os.path.join(tier.root, f"step-{last:010d}")
    data = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(step_dir, "data"))
               for f in fs if f"r{rank:05d}" in f)
    xor = os.path.join(tier.root, "parity", f"step-{last:010d}", f"r{rank}.xor")
    return {"data": data, "parity": os.path.getsize(xor) if os.path.exists(xor) else 0,
            "parity_steps": len(os.listdir(os.path.join(tier.root, "parity")))}


def restore(rank: int, world: int, base: str, per_node: int, parity: int) -> tuple[int | None, bool, dict]:
    """Restore from the tier: (step, exact against the state saved at it, the tier's last_restore)."""
    tier = MemoryTier("parity-test", node=node_of(rank, per_node), base=base, parity=parity)
    st = state_at(rank, world, -1)
    step = tier.restore(st)
    return step, step is not None and _equal(st, state_at(rank, world, step)), dict(tier.last_restore)
