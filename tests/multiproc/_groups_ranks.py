"""Rank functions for the lifetime of liferaft's own gloo groups (imported as ``multiproc._groups_ranks``)."""

from __future__ import annotations

import time

import torch

import liferaft
from liferaft import JobOptions


def save_release_cycles(rank: int, world: int, root: str, cycles: int) -> int:
    """``cycles`` × (save; release_groups) then (manager save; close; save): every one must succeed."""
    opts = liferaft.SaveOptions(timeout=15.0, overwrite=True)
    state = {"w": torch.full((8,), float(rank)), "step": 0}
    done = 0
    for i in range(cycles):
        state["step"] = i
        liferaft.save(f"{root}/plain", state, options=opts)
        liferaft.release_groups()
        if i % 3 == 0:                 # a manager closed, then a plain save in the same process
            with liferaft.CheckpointManager(f"{root}/mgr", every_steps=1, keep_last=1, async_save=i % 2 == 0,
                                            job=JobOptions(lease_ttl=5.0), save_options=opts) as mgr:
                mgr.save(i, state)
            liferaft.save(f"{root}/plain", state, options=opts)
        done += 1
    got = {"w": torch.zeros(8), "step": -1}
    liferaft.load(f"{root}/plain", got)
    assert got["step"] == cycles - 1
    return done


def timeout_is_honoured(rank: int, world: int, root: str) -> str:
    """Rank 1 does not arrive at the second save for 6 s: rank 0 fails within the options' 2 s timeout, as
    DistributedError naming the phase. Then both retry as a job's recovery loop would, and save together again
    (fresh groups replace the broken one; the ranks meet in the newest one)."""
    opts = liferaft.SaveOptions(timeout=2.0, overwrite=True)
    liferaft.save(f"{root}/a", {"w": torch.ones(4)}, options=opts)
    out = "arrived"
    if rank == 0:
        t0 = time.monotonic()
        try:
            liferaft.save(f"{root}/a", {"w": torch.zeros(4)}, options=opts)
            out = "no error"
        except liferaft.DistributedError as e:
            out = f"DistributedError after {time.monotonic() - t0:.1f}s: {e}"
    else:
        time.sleep(6.0)
    deadline = time.monotonic() + 30.0
    while True:
        try:
            liferaft.save(f"{root}/b", {"w": torch.full((4,), 9.0)}, options=opts)
            break
        except liferaft.DistributedError:
            if time.monotonic() > deadline:
                raise
    return out
