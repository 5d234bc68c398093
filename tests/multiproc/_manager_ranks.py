"""Rank functions for the manager on real ranks (imported as ``multiproc._manager_ranks``)."""

from __future__ import annotations

import os
import signal

import torch

import liferaft
from liferaft import CheckpointManager, PreemptionOptions, Sharded

ROWS, COLS = 12, 5


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (step + 1)


def state_at(rank: int, world: int, step: int) -> dict:
    rows = ROWS // world
    return {"w": Sharded(full(step)[rank * rows:(rank + 1) * rows].clone(), (ROWS, COLS), (rank * rows, 0)),
            "rep": torch.full((3,), float(step)), "step": step}


def train_and_preempt(rank: int, world: int, root: str) -> tuple[list[int], bool, int]:
    """Save every 3 steps; at step 7 only rank 1 gets SIGUSR1: every rank must save step 8 and stop there (the
    ranks vote at the end of each maybe_save and act on it at the next)."""
    mgr = CheckpointManager(root, every_steps=3, keep_last=2, preemption=PreemptionOptions(signals=[signal.SIGUSR1]),
                            save_options=liferaft.SaveOptions(timeout=60))
    start = mgr.restore(state_at(rank, world, -1))
    stopped = -1
    for step in range(20):
        if step == 7 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        mgr.maybe_save(step, state_at(rank, world, step))
        if mgr.preempted:
            stopped = step
            break
    mgr.close()
    steps = [i.step for i in mgr.steps() if i.status == "committed"]
    return steps, start is None, stopped


def resume_on_other_layout(rank: int, world: int, root: str) -> tuple[int | None, bool]:
    """Restore the newest step on ``world`` ranks with another sharding; exact values?"""
    with CheckpointManager(root, save_options=liferaft.SaveOptions(timeout=60)) as mgr:
        st = state_at(rank, world, -1)
        step = mgr.restore(st)
    ref = state_at(rank, world, step if step is not None else -1)
    return step, torch.equal(st["w"].local, ref["w"].local) and torch.equal(st["rep"], ref["rep"]) and \
        st["step"] == step


def memory_every_on_jumping_steps(rank: int, world: int, root: str, base: str) -> list[int]:
    """memory_every=5 (step-based) while maybe_save is called at steps 0, 10, 20, ... (a step counter that jumps):
    the memory-tier saves this rank took."""
    from liferaft import MemoryTier, TierOptions

    tier = MemoryTier("memev", node=f"node{rank}", base=base, timeout=20)
    mgr = CheckpointManager(root, save_policy=liferaft.SavePolicy(every_steps=10 ** 6), async_save=False,
                            tiers=TierOptions(memory=tier, memory_every=5, drain=False),
                            save_options=liferaft.SaveOptions(timeout=20))
    mgr.restore({"w": torch.zeros(4)})
    seen: set[int] = set()
    for step in range(0, 70, 10):
        mgr.maybe_save(step, {"w": torch.full((4,), float(rank + step))})
        tier.wait()                     # (a memory save still running makes the next one skip, on every rank)
        seen.update(tier.local_steps())
    mgr.close()
    return sorted(seen)


def signal_at_the_last_maybe_save(rank: int, world: int, root: str) -> list[str]:
    """A preemption signal reaches rank 1 before the loop's last maybe_save: with several ranks it would act at the
    next one, which never comes; close() warns. The warnings' texts."""
    import warnings

    mgr = CheckpointManager(root, preemption=PreemptionOptions(signals=[signal.SIGUSR1]),
                            save_options=liferaft.SaveOptions(timeout=30))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            mgr.maybe_save(step, state_at(rank, world, step))
        mgr.close()
    return [str(w.message) for w in got]


def settle_raises_on_one_rank(rank: int, world: int, root: str) -> tuple[list[int], int, int]:
    """As ``train_and_preempt``, but at step 4 rank 0's accounting of the saves in flight (``_settle``) raises and
    the loop catches it and goes on: the ranks must still take one vote and cast one per call (a rank that
    skipped one would act on the others' votes a step apart: a save started at different steps)."""
    mgr = CheckpointManager(root, every_steps=3, keep_last=2, preemption=PreemptionOptions(signals=[signal.SIGUSR1]),
                            save_options=liferaft.SaveOptions(timeout=20))
    mgr.restore(state_at(rank, world, -1))
    real, caught, stopped = mgr._settle, [0], -1

    def settle() -> None:
        if rank == 0 and mgr._last_call == 3 and not caught[0]:
            raise RuntimeError("injected: the accounting of a save in flight failed on this rank")
        real()

    mgr._settle = settle  # type: ignore[method-assign]
    for step in range(20):
        if step == 7 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        try:
            mgr.maybe_save(step, state_at(rank, world, step))
        except RuntimeError:
            caught[0] += 1
            continue
        if mgr.preempted:
            stopped = step
            break
    mgr.close()
    return [i.step for i in mgr.steps() if i.status == "committed"], caught[0], stopped
