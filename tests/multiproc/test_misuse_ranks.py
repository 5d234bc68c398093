"""A load into a destination that cannot be written in place on one rank of two: every rank refuses before any
byte is written (rank 1 naming the key, rank 0 naming rank 1), and no rank's state changes."""

from __future__ import annotations

import pytest
import torch
from multiproc import _misuse_ranks as R

import liferaft
from liferaft.testing import run_ranks


@pytest.mark.parametrize("kind", ["expand", "as_strided"])
def test_load_refused_on_every_rank_when_one_destination_is_unwritable(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    liferaft.save(path, {"a": torch.ones(4), "w": torch.ones(4, 4), "z": torch.ones(3)})
    r0, r1 = run_ranks(R.load_rank1_unwritable, 2, path, kind, timeout=150.0, pg_timeout=60.0)
    assert r1[0] == "InvalidStateError" and "'w'" in r1[1] and r1[2], r1
    assert r0[0] == "DistributedError" and "rank 1" in r0[1] and r0[2], r0


def test_a_load_whose_options_differ_between_ranks_is_refused_on_every_rank_and_the_next_one_works(tmp_path):
    path = str(tmp_path / "ckpt")
    liferaft.save(path, {"x": torch.arange(6.0), "y": torch.ones(4)})
    for first, second in run_ranks(R.load_with_strict_on_rank0_then_again, 2, path, timeout=150.0, pg_timeout=60.0):
        assert first[0] == "OptionsError" and "different strict=" in first[1], first
        assert second == ("ok", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), second


def test_options_that_mean_the_same_on_every_rank_are_agreed(tmp_path):
    path = str(tmp_path / "ckpt")
    liferaft.save(path, {"x": torch.arange(6.0), "y": torch.ones(4), "z": torch.ones(2)})
    assert run_ranks(R.load_with_ignore_keys_in_rank_order, 2, path, timeout=150.0, pg_timeout=60.0) == ["ok", "ok"]
