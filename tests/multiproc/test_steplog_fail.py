"""The per-step log failing on one rank alone (a replication that failed, a record forgotten) while the loop
catches the error and goes on: the ranks stay in step — one vote taken and one cast per ``maybe_save`` on every
rank, the ring's size and its fullness agreed — so that a preemption stops them at the same step and every save is
taken by all."""

from __future__ import annotations

import pytest
from multiproc._steplog_fail_ranks import one_rank_fails

from liferaft.testing import run_ranks


@pytest.mark.parametrize("where,at,max_steps", [("capture", 1, "auto"), ("publish", 9, "auto"), ("publish", 9, 64)])
def test_a_record_that_fails_on_one_rank_keeps_the_ranks_in_step(tmp_path, where, at, max_steps):
    # capture at 1: an auto ring is sized at that record (an all-reduce): the failing rank votes too; the
    # replication of the step goes on with nothing from that rank (else the peers' exchanges were one ahead for
    # the rest of the run, and the last one hung at close)
    out = run_ranks(one_rank_fails, 2, str(tmp_path / "r"), str(tmp_path / "shm"), where, at, 11, max_steps,
                    timeout=150)
    assert out[0]["caught"] == 1 and out[1]["caught"] == 0
    assert out[0]["stopped"] == out[1]["stopped"] == 12, out      # the signal after 11: acted on at 12 by both
    assert out[0]["committed"] == out[1]["committed"] and 12 in out[0]["committed"], out
    assert out[0]["ring"] == out[1]["ring"], out
    # the hole in rank 0's chain asks every rank for a full checkpoint at once (voted at the end of the next call)
    assert any(at < s <= at + 3 for s in out[0]["committed"]), out


def test_a_ring_full_on_one_rank_only_takes_the_synchronous_save_on_every_rank(tmp_path):
    # a 4-slot ring, no early saves: full checkpoint 0, records 1..4 fill it; rank 0 forgets the record of 3
    # before the call of 4, so its ring holds 3 records where rank 1's holds 4 (voted full at the end of 3)
    out = run_ranks(one_rank_fails, 2, str(tmp_path / "r"), str(tmp_path / "shm"), "forget", 3, None, 4,
                    timeout=150)
    assert out[0]["caught"] == out[1]["caught"] == 0
    assert out[0]["committed"] == out[1]["committed"] and 4 in out[0]["committed"], out
    assert out[0]["durable"] == out[1]["durable"], out
