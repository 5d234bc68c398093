"""``Coordinator.run`` / ``run_on_zero`` on real gloo ranks: a step that fails on one rank raises on every rank;
the plan cache is keyed by the group, so a remade group plans anew; ``liferaft.release()`` frees it all."""

from multiproc._dist_run_ranks import plans_after_regroup, run_and_run_on_zero, tier_listing_fails_on_one_rank

from liferaft.testing import run_ranks


def test_run_raises_on_every_rank_and_run_on_zero_runs_on_rank_zero_only():
    out = run_ranks(run_and_run_on_zero, 3, timeout=120)
    for rank, o in enumerate(out):
        assert o["gathered"] == [0, 10, 20]
        kind, msg = o["failure"]
        if rank == 1:           # the failing rank: its own exception
            assert (kind, msg) == ("ValueError", "boom on rank 1"), o["failure"]
        else:                   # the others: a DistributedError naming the phase, the rank and its error
            assert kind == "DistributedError", o["failure"]
            assert msg.startswith("test (one fails) failed on 1 of 3 ranks:"), msg
            assert "rank 1: ValueError: boom on rank 1" in msg, msg
        assert o["cleaned"] == [rank]           # cleanup ran on every rank before it raised
        assert o["after"] == [0, 1, 2]
        assert o["zero"] == "read by rank 0"
        assert o["zero_calls"] == ([0] if rank == 0 else [])
        kind, msg = o["zero_failure"]
        if rank == 0:
            assert (kind, msg) == ("FileNotFoundError", "nothing there for rank 0"), o["zero_failure"]
        else:
            assert kind == "DistributedError", o["zero_failure"]
            assert "test (rank 0 fails) failed on rank 0" in msg and "FileNotFoundError" in msg, msg


def test_a_remade_group_plans_anew_and_release_frees_plans_pools_and_groups(tmp_path):
    for o in run_ranks(plans_after_regroup, 2, str(tmp_path), timeout=120):
        (key1, plan1), save1 = o["first"]
        assert plan1 == save1                               # planned for the first save
        assert o["second"] == (key1, plan1)                 # reused by the second
        (key3, plan3), save3 = o["third"]
        assert key3 != key1 and plan3 == save3              # after release_groups: a new group, a new plan
        assert o["entries"] == 2
        assert o["released"] == (True, 0, True, None)
        assert o["loaded"]


def test_a_memory_tier_listing_that_fails_on_one_rank_raises_on_every_rank_at_once(tmp_path):
    # before: the rank that failed to list raised alone; the other learnt of it only when that process exited
    # ("a peer died"), or after the whole timeout if it lived on
    out = run_ranks(tier_listing_fails_on_one_rank, 2, str(tmp_path), timeout=120)
    assert out[1][0] == "FileNotFoundError", out[1]
    assert out[0][0] == "DistributedError", out[0]
    assert out[0][1].startswith("memory tier (listing) failed on 1 of 2 ranks:"), out[0][1]
    assert "rank 1: FileNotFoundError" in out[0][1], out[0][1]
