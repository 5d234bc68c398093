"""A per-step log's replay that fails on one rank alone after every check passed: every rank raises naming that
rank and step, the records from it on are removed on every node, and a restore into a state made anew resumes at
the step before it on every rank, bit for bit."""

from __future__ import annotations

from multiproc._steplog_replay_ranks import replay_fails_on_one_rank

from liferaft.testing import run_ranks


def test_a_replay_that_fails_on_one_rank_stops_every_rank_and_resumes_before_it(tmp_path):
    out = run_ranks(replay_fails_on_one_rank, 2, str(tmp_path / "r"), str(tmp_path / "shm"), 1, 7, timeout=240)
    for o in out:
        assert isinstance(o["first"], str) and "rank 1, step 7" in o["first"] and "resumes at step 6" in o["first"]
        assert o["second"] == 6 and o["count"] == 7
        assert o["restored"] == o["trained"]            # (the training's state after step 6, bit for bit)
