"""Rank functions for RNGState on real ranks (imported as ``multiproc._rng_ranks``)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch

import liferaft


def draw() -> list:
    return torch.rand(4).tolist() + np.random.rand(2).tolist() + [random.random()]


def save_and_draw(rank: int, world: int, path: str) -> list:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    liferaft.save(path, {"rng": liferaft.RNGState()})
    return draw()


def load_and_draw(rank: int, world: int, path: str) -> tuple[list, bool]:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        liferaft.load(path, {"rng": liferaft.RNGState()})
    return draw(), any("fresh random streams" in str(w.message) for w in caught)


def save_shared_torch_seed(rank: int, world: int, path: str) -> None:
    """torch seeded alike on every rank (stored once), numpy left to OS entropy (differs per rank)."""
    torch.manual_seed(7)
    np.random.seed(None)
    liferaft.save(path, {"rng": liferaft.RNGState()})
