"""Rank functions for the crash tests (imported as ``multiproc._crash_ranks``): a job that trains, saves every
step through the manager on ``crash://`` storage and may be ``kill -9``-ed at a chosen point. Its state holds a
frozen tensor, so every step after step 0 references step 0's chunks of it (incremental saves)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import liferaft
from liferaft import CheckpointManager, JobOptions, Sharded
from liferaft.storage import register_scheme
from liferaft.testing.faults import CrashPlan, CrashStorage

ROWS, COLS = 1024, 640          # 2.5 MiB per tensor: several writes per data file


def state_at(rank: int, world: int, step: int) -> dict[str, Any]:
    """The state after ``step`` in a ``world``-rank layout (rows split evenly); a pure function of the step."""
    rows = ROWS // world
    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randn(ROWS, COLS, generator=g)
    frozen = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))    # the same at every step
    return {"w": Sharded(full[rank * rows:(rank + 1) * rows].clone(), (ROWS, COLS), (rank * rows, 0)),
            "frozen": Sharded(frozen[rank * rows:(rank + 1) * rows].clone(), (ROWS, COLS), (rank * rows, 0)),
            "m": Sharded((full[rank * rows:(rank + 1) * rows] * 2).clone(), (ROWS, COLS), (rank * rows, 0)),
            "rep": torch.full((5,), float(step)), "step": step}


def job(rank: int, world: int, root: str, last: int, crash_step: int, plan: dict | None,
        crash_ranks: list[int], kill_after_call: bool = False) -> tuple[int | None, bool]:
    """Restore, then train and save up to step ``last``; at ``crash_step`` the ranks in ``crash_ranks`` arm
    ``plan`` (a CrashPlan as a dict), or with ``kill_after_call`` die right after maybe_save returns (the
    snapshot is taken, the background save running). Returns (restored step, restored state exact)."""
    register_scheme("crash", CrashStorage)
    mgr = CheckpointManager(f"crash://{root}", every_steps=1, keep_last=2,
                            job=JobOptions(job_id="crash-test", lease_ttl=5.0),
                            save_options=liferaft.SaveOptions(timeout=30))
    st = state_at(rank, world, -1)
    start = mgr.restore(st)
    exact = start is None or _equal(st, state_at(rank, world, start))
    for step in range(0 if start is None else start + 1, last + 1):
        mine = step == crash_step and rank in crash_ranks
        if mine and plan is not None:
            CrashStorage.arm(CrashPlan(**plan))
        mgr.maybe_save(step, state_at(rank, world, step))
        if mine and kill_after_call:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    return start, exact


def restore_crashing(rank: int, world: int, root: str, plan: dict, crash_ranks: list[int]) -> None:
    """A resume that dies while reading (``plan`` armed on ``crash_ranks`` before the restore)."""
    register_scheme("crash", CrashStorage)
    if rank in crash_ranks:
        CrashStorage.arm(CrashPlan(**plan))
    mgr = CheckpointManager(f"crash://{root}", job=JobOptions(job_id="crash-test", lease_ttl=5.0),
                            save_options=liferaft.SaveOptions(timeout=30))
    mgr.restore(state_at(rank, world, -1))
    mgr.close()


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (torch.equal(a["w"].local, b["w"].local) and torch.equal(a["m"].local, b["m"].local)
            and torch.equal(a["frozen"].local, b["frozen"].local)
            and torch.equal(a["rep"], b["rep"]) and a["step"] == b["step"])
