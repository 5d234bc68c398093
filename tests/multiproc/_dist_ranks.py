"""Rank functions for collective failure tests (imported as ``multiproc._dist_ranks``)."""

from __future__ import annotations

import time

import torch

import liferaft


def hang_on_second_save(rank: int, world: int, path: str) -> str:
    opts = liferaft.SaveOptions(timeout=3.0, overwrite=True)
    liferaft.save(path, {"w": torch.ones(4)}, options=opts)      # warm: both ranks present
    if rank == 1:
        time.sleep(10)                                           # a rank that stops answering
        return "slept"
    try:
        liferaft.save(path, {"w": torch.zeros(4)}, options=opts)
    except liferaft.DistributedError as e:
        return f"DistributedError: {e}"
    return "no error"
