"""RNGState: a resumed process continues exactly the random streams it saved (torch, numpy, Python random)."""

from __future__ import annotations

import random

import numpy as np
import torch

import liferaft


def draw():
    return torch.rand(5).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], \
        torch.randn(2, generator=None).tolist()


def test_streams_continue_exactly_after_a_load(tmp_path):
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    draw()
    np.random.randn()                                   # leaves a cached gaussian in numpy's state
    liferaft.save(str(tmp_path / "ck"), {"rng": liferaft.RNGState(), "step": 3})
    expected = draw()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    assert draw() != expected
    liferaft.load(str(tmp_path / "ck"), {"rng": liferaft.RNGState(), "step": 0})
    assert draw() == expected
