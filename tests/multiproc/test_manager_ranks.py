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


def test_a_step_based_memory_interval_is_decided_by_each_rank_on_jumping_steps(tmp_path):
    """A step-based memory_every is the same on every rank: not voted a step ahead (that assumed the next call
    is for step + 1), so a step counter that jumps by 10 still saves into memory at every call."""
    from multiproc._manager_ranks import memory_every_on_jumping_steps

    out = run_ranks(memory_every_on_jumping_steps, 2, str(tmp_path / "r"), str(tmp_path / "shm"), timeout=120)
    for steps in out:
        assert len(set(steps) & {10, 20, 30, 40, 50, 60}) >= 3, out    # (step 0: the root save's)


def test_a_signal_at_the_last_maybe_save_is_reported_at_close(tmp_path):
    from multiproc._manager_ranks import signal_at_the_last_maybe_save

    out = run_ranks(signal_at_the_last_maybe_save, 2, str(tmp_path / "r"), timeout=120)
    for texts in out:
        assert any("preemption signal" in t and "step 3" in t for t in texts), texts


def test_a_rank_whose_settle_raises_once_keeps_its_votes_in_step(tmp_path):
    from multiproc._manager_ranks import settle_raises_on_one_rank

    out = run_ranks(settle_raises_on_one_rank, 2, str(tmp_path / "r"), timeout=120)
    assert out[0][1] == 1 and out[1][1] == 0, out      # rank 0 raised once at step 4 and went on
    for steps, _, stopped in out:
        assert stopped == 8 and steps == [6, 8], out    # both still act on rank 1's signal at the same step
