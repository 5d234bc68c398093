"""Collectives: no hang when a rank stops answering; the previous checkpoint survives."""

import torch
from multiproc._dist_ranks import hang_on_second_save

import liferaft
from liferaft.dist import Coordinator
from liferaft.testing import run_ranks


def test_a_silent_rank_makes_save_time_out_instead_of_hanging(tmp_path):
    path = str(tmp_path / "ck")
    out = run_ranks(hang_on_second_save, 2, path, timeout=120)
    assert out[1] == "slept"
    assert out[0].startswith("DistributedError") and "rank 0 of 2" in out[0], out[0]
    assert torch.equal(liferaft.read(path)["w"], torch.ones(4))     # the committed checkpoint is intact


def test_coordinator_without_process_group():
    c = Coordinator()
    assert (c.rank, c.world) == (0, 1)
    assert c.exchange(5) == [5]
    try:
        c.exchange(None, ValueError("boom"))
    except ValueError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("expected the local error")


def test_sending_to_a_dead_peer_is_a_distributed_error_and_breaks_the_group(tmp_path):
    import json

    from multiproc._dist_ranks import p2p_after_a_peer_died

    from liferaft.testing import RankFailure

    out = tmp_path / "seen.json"
    try:
        run_ranks(p2p_after_a_peer_died, 2, str(out), timeout=120)
    except RankFailure as e:
        assert set(e.errors) == {1}, e
    got = json.loads(out.read_text())
    assert got["seen"].startswith("DistributedError") and got["broken"], got


def test_scatter_from_zero_sends_each_rank_its_own_message_and_rank_zeros_error_to_all(tmp_path):
    from multiproc._dist_ranks import scatter

    out = run_ranks(scatter, 3, False, timeout=120)
    assert out == [["0", "1", "0", "0"], ["0", "0", "0", "1"], ["2000", "2001", "0", "2"]], out
    out = run_ranks(scatter, 3, True, timeout=120)
    assert out[0][2] == "ValueError: no base here", out
    assert all(o[2].startswith("DistributedError") and "no base here" in o[2] for o in out[1:]), out
    assert [o[3] for o in out] == ["0", "1", "2"], out     # (the group still works)
    assert Coordinator().scatter_from_zero(["only"]) == "only"


def test_peers_alike_sends_each_rank_the_ranks_of_its_value_only():
    from multiproc._dist_ranks import alike

    assert run_ranks(alike, 4, timeout=120) == [(0, 3), (1, 2), (1, 2), (0, 3)]
    assert Coordinator().peers_alike(5, "alone") == (0,)


def test_messages_of_every_length_around_the_first_round_arrive_whole_on_every_rank():
    """A collective's message goes in one round when every rank's fits its first (with its length: ``head_size``
    bytes for an all-gather, ``BROADCAST_HEAD`` for a broadcast), in two otherwise: lengths at the boundary, empty
    ones, ranks with different lengths, a large one beside empty ones, a large world's small head."""
    from multiproc._dist_ranks import sizes_across_the_first_round

    from liferaft.dist.wire import HEAD, HEAD_TOTAL, LEN, head_size

    assert head_size(3) == HEAD and head_size(1024) == HEAD_TOTAL // 1024 and head_size(10**6) == LEN
    for rank, seen in enumerate(run_ranks(sizes_across_the_first_round, 3, timeout=180)):
        assert len(seen) == 2 * 8 * 3 + 7
        assert all(ok for *_, ok in seen), (rank, [s for s in seen if not s[-1]])
        for what, n, kind, rounds, _ in seen:
            room = (int(what.split()[-1]) if what.startswith("allgather") else 256) - LEN
            longest = n + 17 * 2 if kind == "own" else n
            assert rounds == (1 if longest <= room else 2), (rank, what, n, kind, rounds)


def test_a_length_past_the_limits_is_refused_on_every_rank_before_anything_is_allocated():
    """A rank announcing an absurd message length in a collective's first round (2**62 bytes; one past
    MAX_MESSAGE; one that would make every rank receive more than MAX_RECEIVED) makes every rank raise a
    DistributedError naming that rank — none allocates it, none waits in a second round — and the group works
    after, also when the refusal came through the public exchange (it is not retired as a lost peer's is)."""
    from multiproc._dist_ranks import forged_lengths

    results = run_ranks(forged_lengths, 3, timeout=120)
    for rank, out in enumerate(results):
        assert out[-1] == "still works: True", (rank, out)
        assert "rank 1 announced a message of 4611686018427387904 bytes" in out[0], (rank, out)
        assert "rank 1 announced a message of" in out[1], (rank, out)
        assert "rank 1's message of" in out[2] and "would make every one of 3 ranks receive" in out[2], (rank, out)
        assert "rank 0 announced a message of 1099511627776 bytes" in out[3], (rank, out)
        assert out[4].startswith("DistributedError: forged exchange: ") and "announced" in out[4], (rank, out)
        assert "did not arrive" not in out[4], (rank, out)
    assert results[0] == results[1] == results[2]


def test_a_forged_length_in_a_gather_to_rank_zero_is_refused_by_every_rank_before_allocating():
    """gather_to_zero's sizes reach rank 0 alone, so each rank's length is also voted in the gather's first
    all-reduce: a length past the limits (or negative) makes every rank raise RefusedLength naming that rank,
    before any buffer is made, and the group works after."""
    from multiproc._dist_ranks import forged_one_side

    results = run_ranks(forged_one_side, 3, timeout=120)
    for rank, out in enumerate(results):
        assert out[-1] == "still works: True", (rank, out)
        assert out[0] != "accepted" and out[1] != "accepted" and out[2] != "accepted", (rank, out)
    for rank, out in enumerate(results):
        assert all("rank 1 announced a message of" in o for o in out[:1]), (rank, out)
        assert "rank 2 announced a message of" in out[1] and "rank 0 announced a message of" in out[2], (rank, out)
    assert "rank 1 announced a message of 1099511627776 bytes" in results[1][0], results[1]
    assert "rank 2 announced a message of -7 bytes" in results[2][1], results[2]
    assert f"rank 0 announced a message of {(1 << 33) + 1} bytes" in results[0][2], results[0]


def test_swap_among_exchanges_within_a_group_in_one_round_or_two_and_refuses_a_forged_length():
    """``Coordinator.swap_among`` (a host's ranks exchanging their read spans): every message arrives whole and
    in place, one round for short ones, a second for the rest of long ones, groups apart from each other; a length
    past the limits is refused before anything is allocated, naming the rank."""
    from multiproc._dist_ranks import swapped_among

    from liferaft.dist.wire import HEAD, LEN

    results = run_ranks(swapped_among, 3, timeout=120)
    sizes = [(10, 20), (HEAD * 3, HEAD * 5), (HEAD * 2, 3), (0, HEAD - LEN)]
    for i, (n0, n2) in enumerate(sizes):
        both = {0: b"x" * n0 + bytes([0]), 2: b"x" * n2 + bytes([2])}
        assert results[0][i] == both and results[2][i] == both, i
        assert results[1][i] == {1: b"x" * 7 + bytes([1])}, i
    assert "rank 2 announced a message of" in results[0][-1], results[0][-1]
    assert results[1][-1] == "accepted"           # (alone in its group: nothing to receive)
