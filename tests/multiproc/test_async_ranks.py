"""async_save on real ranks: resharding after an async save, background errors on every rank, collective skip."""

from __future__ import annotations

import pytest
from multiproc._async_ranks import async_save_layout, plan_reuse, rank1_write_fails, skip_is_collective
from multiproc._reshard_ranks import load_rank

import liferaft
from liferaft.testing import run_ranks

S0 = {"kind": "dtensor", "mesh": (2,), "placements": ["S0"]}
S1_3 = {"kind": "dtensor", "mesh": (3,), "placements": ["S1"]}


@pytest.mark.parametrize("staging,budget", [("blocking", None), ("overlapped", None), ("blocking", 1 << 20)],
                         ids=["blocking", "overlapped", "waves"])
def test_async_save_on_2_ranks_then_reshard_to_3(tmp_path, staging, budget):
    path = str(tmp_path / "ck")
    run_ranks(async_save_layout, 2, path, S0, staging, budget)
    liferaft.verify(path)
    for rank, res in enumerate(run_ranks(load_rank, 3, path, S1_3)):     # values at snapshot time
        assert all(res.values()), f"rank {rank}: {res}"


def test_background_failure_on_one_rank_raises_on_every_rank(tmp_path):
    out = run_ranks(rank1_write_fails, 2, str(tmp_path / "ck"), timeout=120)
    assert out[1].startswith("StorageError") and "injected" in out[1], out[1]
    assert out[0].startswith("DistributedError") and "rank 1" in out[0], out[0]
    with pytest.raises(liferaft.CheckpointNotFoundError):     # every rank removed its partial file
        liferaft.read(str(tmp_path / "ck"))


def test_if_busy_skip_is_agreed_by_all_ranks(tmp_path):
    for skipped, committed in run_ranks(skip_is_collective, 2, str(tmp_path), timeout=120):
        assert skipped and committed


def test_save_plan_is_reused_only_while_every_rank_describes_the_same_tensors(tmp_path):
    for rank, ok in enumerate(run_ranks(plan_reuse, 2, str(tmp_path), timeout=120)):
        assert all(ok), f"rank {rank}: {ok}"
