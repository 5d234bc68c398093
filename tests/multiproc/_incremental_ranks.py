"""Rank functions for incremental saves on real ranks (imported as ``multiproc._incremental_ranks``): whether a
save references an older step is decided on the whole save's bytes, the same on every rank, even where one
rank's own share of unchanged chunks alone would say the opposite."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import liferaft
from liferaft import CheckpointManager, Sharded
from liferaft.manager.manager import list_steps
from liferaft.storage import resolve

COLS = 1024                     # float32: 4 KiB per row
W_ROWS = 1024                   # changes every step; rank 0 holds rows 0..63, rank 1 the rest
SPLIT = 64


def _rows(full: torch.Tensor, lo: int, hi: int) -> Sharded:
    return Sharded(full[lo:hi].clone(), tuple(full.shape), (lo, 0))


def state_at(rank: int, step: int, frozen_rows: int, frozen_split: int) -> dict[str, Any]:
    """``w`` changes at every step (rank 0: 256 KiB of it, rank 1: 3.75 MiB); ``frozen`` never changes (rank 0
    holds its rows below ``frozen_split``, rank 1 the others)."""
    w = torch.randn(W_ROWS, COLS, generator=torch.Generator().manual_seed(100 + step))
    frozen = torch.randn(frozen_rows, COLS, generator=torch.Generator().manual_seed(7))
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, W_ROWS)
    flo, fhi = (0, frozen_split) if rank == 0 else (frozen_split, frozen_rows)
    return {"w": _rows(w, lo, hi), "frozen": _rows(frozen, flo, fhi), "step": step}


def run(rank: int, world: int, root: str, frozen_rows: int, frozen_split: int) -> dict[str, Any]:
    """Save steps 0..3 (keep_last=2), then restore the newest into a fresh state; what is on disk and exact?"""
    assert world == 2
    mgr = CheckpointManager(root, every_steps=1, keep_last=2, save_options=liferaft.SaveOptions(timeout=60))
    for step in range(4):
        mgr.maybe_save(step, state_at(rank, step, frozen_rows, frozen_split))
    mgr.wait()                          # (restore does not wait for the save in flight)
    fresh = state_at(rank, -1, frozen_rows, frozen_split)
    fresh["frozen"].local.zero_()
    restored = mgr.restore(fresh)
    mgr.close()                         # waits for the deletions
    info = {i.step: i.depends_on for i in list_steps(resolve(root))}
    want = state_at(rank, 3, frozen_rows, frozen_split)
    exact = all(torch.equal(fresh[k].local, want[k].local) for k in ("w", "frozen")) and fresh["step"] == 3
    step_dir = os.path.join(root, "step-0000000003")
    marker = json.load(open(os.path.join(step_dir, "COMMIT")))
    manifest = json.load(open(os.path.join(step_dir, marker["manifest"])))
    frozen_files = sorted({c["file"] for t in manifest["tensors"] if t["key"] == "frozen" for c in t["chunks"]})
    return {"restored": restored, "exact": exact, "steps": info, "frozen_files": frozen_files}
