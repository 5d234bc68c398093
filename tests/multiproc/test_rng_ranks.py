"""RNGState on real ranks: same world size → every rank continues its own stream; another world size → fresh,
distinct, reproducible streams and a warning, never an error."""

from __future__ import annotations

from multiproc._rng_ranks import load_and_draw, save_and_draw, save_shared_torch_seed

from liferaft.testing import run_ranks


def test_each_rank_continues_its_stream_and_a_new_world_gets_derived_streams(tmp_path):
    path = str(tmp_path / "ck")
    expected = run_ranks(save_and_draw, 2, path)
    assert expected[0] != expected[1]
    same = run_ranks(load_and_draw, 2, path)
    assert [d for d, _ in same] == expected and not any(w for _, w in same)
    three = run_ranks(load_and_draw, 3, path)
    draws = [d for d, _ in three]
    assert all(w for _, w in three) and len({tuple(d) for d in draws}) == 3
    assert run_ranks(load_and_draw, 3, path) == three          # reproducible


def test_a_stream_equal_on_all_ranks_next_to_ones_that_differ(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(save_shared_torch_seed, 2, path)
    assert [w for _, w in run_ranks(load_and_draw, 2, path)] == [False, False]
    three = run_ranks(load_and_draw, 3, path)
    assert all(w for _, w in three) and len({tuple(d) for d, _ in three}) == 3


def test_a_save_by_one_rank_gives_more_ranks_distinct_streams(tmp_path):
    # (one saving rank stores nothing per rank: its streams reached every new rank alike, silently)
    path = str(tmp_path / "ck")
    expected = run_ranks(save_and_draw, 1, path)
    assert run_ranks(load_and_draw, 1, path) == [(expected[0], False)]
    two = run_ranks(load_and_draw, 2, path)
    assert all(w for _, w in two) and two[0][0] != two[1][0] and expected[0] not in [d for d, _ in two]
