"""torchdata's StatefulDataLoader on 2 real ranks (issue 14, item 4): shuffled with a generator per rank, saved
mid-epoch, resumed in new processes: every rank yields exactly the batches of an uninterrupted run. PyTorch DCP
keeps one rank's generator state for all ranks here (rank 1 would follow rank 0's order after a resume)."""

from __future__ import annotations

import pytest
from multiproc._loader_ranks import global_resume, global_save_go_on, resume, resume_refused, train_save_go_on

from liferaft.testing import run_ranks

pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
def test_each_rank_resumes_its_own_shuffled_order(tmp_path, workers):
    path = str(tmp_path / "ck")
    runs = run_ranks(train_save_go_on, 2, path, workers)
    (before0, after0), (before1, after1) = runs
    assert before0 != before1 and after0 != after1                 # the ranks do shuffle differently
    assert run_ranks(resume, 2, path, workers) == [after0, after1]


def test_another_world_size_is_refused_before_loading_anything(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(train_save_go_on, 2, path, 0)
    for world in (3, 1):
        errors = run_ranks(resume_refused, world, path)
        assert all("StatefulDataLoader" in e and "GlobalSampler" in e and "2 saving ranks" in e for e in errors), errors


def test_a_global_sampler_loader_reshards_to_another_world_size(tmp_path):
    path = str(tmp_path / "ck")
    two = run_ranks(global_save_go_on, 2, path)
    three = run_ranks(global_resume, 3, path)
    order = lambda per_rank: [x for b in range(6) for share in per_rank for x in share[b]]
    assert order(three) == order(two)
