"""CheckpointManager on real ranks: agreement on preemption (one rank signalled → all save and stop), retention
across ranks, and a resume on another number of ranks."""

from __future__ import annotations

from multiproc._manager_ranks import resume_on_other_layout, train_and_preempt

from liferaft.testing import run_ranks


def test_preemption_of_one_rank_saves_everywhere_then_resume_on_3_ranks(tmp_path):
    root = str(tmp_path / "run")
    out = run_ranks(train_and_preempt, 2, root, timeout=120)
    for steps, fresh, stopped in out:
        assert fresh and stopped == 8, out
        assert steps == [6, 8], out            # saved 0, 3, 6, then 8 on rank 1's vote at 7; keep_last=2
    for step, exact in run_ranks(resume_on_other_layout, 3, root, timeout=120):
        assert step == 8 and exact
