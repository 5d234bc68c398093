"""Rank functions for plain values that differ per rank (imported as ``multiproc._per_rank_ranks``)."""

from __future__ import annotations

import numpy as np
import torch

import liferaft


def state_of(rank: int) -> dict:
    """Plain tensors, a large numpy array and large bytes, each either different per rank or the same."""
    return {
        "mine": torch.arange(5056, dtype=torch.uint8) + rank,           # like a generator state
        "counter": torch.tensor(10 + rank),
        "same": torch.arange(6.0),
        "big_np": np.full(20_000, rank, dtype=np.float32),             # stored as data (over 64 KiB)
        "big_bytes": bytes([rank]) * 70_000,
        "nested": {"t": torch.full((2, 3), float(rank)), "step": 7},
    }


def template() -> dict:
    return {"mine": torch.zeros(5056, dtype=torch.uint8), "counter": torch.tensor(0), "same": torch.zeros(6),
            "big_np": None, "big_bytes": None, "nested": {"t": torch.zeros(2, 3), "step": 0}}


def save(rank: int, world: int, path: str, asynchronous: bool) -> None:
    state = state_of(rank)
    if asynchronous:
        liferaft.async_save(path, state).wait()
        liferaft.async_save(path + "-again", state).wait()      # a second save (plan reuse) of the same
    else:
        liferaft.save(path, state)


def load(rank: int, world: int, path: str) -> dict:
    state = template()
    liferaft.load(path, state)
    return {k: (v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else v) for k, v in state.items()
            if k != "nested"} | {"nested.t": state["nested"]["t"].tolist(), "nested.step": state["nested"]["step"]}


def load_other_world(rank: int, world: int, path: str) -> str:
    try:
        liferaft.load(path, template())
    except liferaft.StateMismatchError as e:
        return str(e)
    return ""


def change_then_save(rank: int, world: int, path: str) -> None:
    """Save with equal copies, then with copies that differ, then equal again: the plan follows."""
    state = state_of(0)
    liferaft.save(path + "-0", state)
    state["mine"] += rank
    liferaft.save(path + "-1", state)
    state["mine"] -= rank
    liferaft.save(path + "-2", state)


def save_held_by_some(rank: int, world: int, path: str) -> None:
    """Rank 0 alone holds ``only0``; both hold ``none_or_one`` (None on rank 1: a value, not an absence)."""
    state = {"common": torch.ones(2), "none_or_one": 1 if rank == 0 else None}
    if rank == 0:
        state["only0"] = 11
    liferaft.save(path, state)


def load_held_by_some(rank: int, world: int, path: str, strict: bool) -> tuple:
    state = {"common": torch.zeros(2), "none_or_one": -1, "only0": -1}
    try:
        r = liferaft.load(path, state, strict=strict)
    except liferaft.errors.StateMismatchError as e:
        return ("refused", "only0" in str(e))
    return (state["only0"], state["none_or_one"], tuple(r.missing_keys))
