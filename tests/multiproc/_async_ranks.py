"""Rank functions for async save on real ranks (imported as ``multiproc._async_ranks``)."""

from __future__ import annotations

import torch
from multiproc._reshard_ranks import build_state

import liferaft
from liferaft.storage import PosixStorage, register_scheme
from liferaft.testing.faults import FailingStorage, GatedStorage


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


def plan_reuse(rank: int, world: int, root: str) -> list[bool]:
    """Four saves: the same layout twice (the plan is reused), then rank 1 alone adds a tensor (every rank
    replans), then a shape change. Returns, per save, whether it loaded back exactly, and whether the plans were
    reused exactly when they should be."""
    from liferaft.core.caches import PLANS

    def state(step: int, extra: bool, rows: int) -> dict:
        s = {"w": liferaft.Sharded(torch.full((rows, 3), float(step + rank)), (2 * rows, 3), (rank * rows, 0)),
             "step": step}
        if extra:
            s["only1"] = torch.arange(4.0) + step if rank == 1 else None
        return {k: v for k, v in s.items() if v is not None}

    plans, ok = [], []
    for i, (extra, rows) in enumerate([(False, 2), (False, 2), (True, 2), (True, 3)]):
        st = state(i, extra, rows)
        liferaft.save(f"{root}/{i}", st, options=liferaft.SaveOptions(timeout=60))
        plans.append(next(v for k, v in PLANS.items() if k[1] == rank)[2])
        back = state(-100, extra, rows)
        liferaft.load(f"{root}/{i}", back, options=liferaft.LoadOptions(timeout=60))
        ok.append(torch.equal(back["w"].local, st["w"].local) and back["step"] == i and
                  (not extra or rank != 1 or torch.equal(back["only1"], st["only1"])))
    # saves 0 and 1 share a plan; 2 and 3 were planned anew
    ok.append(plans[0] == plans[1] and len({plans[1], plans[2], plans[3]}) == 3)
    return ok
