"""Rank functions for async save on real ranks (imported as ``multiproc._async_ranks``)."""

from __future__ import annotations

import torch

import liferaft
from liferaft.storage import PosixStorage, register_scheme
from liferaft.testing.faults import FailingStorage, GatedStorage
from multiproc._reshard_ranks import build_state


def async_save_layout(rank: int, world: int, path: str, layout: dict, staging: str, budget: int | None) -> float:
    state = build_state(rank, world, layout, "ref")
    h = liferaft.async_save(path, state, options=liferaft.SaveOptions(staging=staging, memory_budget=budget))
    h.wait_staged()
    for name in ("a", "b", "c"):                 # the next optimizer step changes everything
        t = state[name].to_local() if hasattr(state[name], "to_local") else state[name]
        t.add_(1)
    res = h.wait()
    return res.timings["blocked"]


def rank1_write_fails(rank: int, world: int, path: str) -> str:
    register_scheme("rankfail", FailingStorage if rank == 1 else PosixStorage)
    h = liferaft.async_save(f"rankfail://{path}", {"w": torch.ones(4096), "x": torch.zeros(4096)})
    try:
        h.wait(timeout=60)
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def skip_is_collective(rank: int, world: int, path: str) -> tuple[bool, bool]:
    """Rank 0's first save is slow; a second save with if_busy="skip" must be skipped on BOTH ranks."""
    register_scheme("rankslow", GatedStorage if rank == 0 else PosixStorage)
    state = {"w": torch.ones(4096), "x": torch.zeros(4096)}
    h = liferaft.async_save(f"rankslow://{path}/a", state)
    skipped = liferaft.async_save(f"{path}/b", state, options=liferaft.SaveOptions(if_busy="skip")) is None
    GatedStorage.gate.set()
    h.wait(timeout=60)
    return skipped, liferaft.inspect(f"{path}/a").world_size == world
