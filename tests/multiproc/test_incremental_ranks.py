"""Incremental saves on 2 ranks: the decision to reference an older step or to copy its few unchanged chunks is
taken on the whole save (all ranks' chunks), identically on every rank (issue #14, item 6)."""

from __future__ import annotations

from multiproc._incremental_ranks import run

from liferaft.testing import run_ranks


def test_crumbs_are_copied_on_every_rank_even_where_one_rank_holds_a_large_share_of_them(tmp_path):
    # frozen: 17 rows (68 KiB, 1.7 % of a step); rank 0 holds 16 of them, 20 % of its own bytes
    out = run_ranks(run, 2, str(tmp_path / "run"), 17, 16, timeout=180)
    for r in out:
        assert r["restored"] == 3 and r["exact"], out
        assert r["steps"] == {2: (), 3: ()}, out          # keep_last=2, nothing pinned
        assert not any(f.startswith("../") for f in r["frozen_files"]), out


def test_a_large_frozen_share_is_referenced_on_every_rank_even_where_one_rank_holds_crumbs_of_it(tmp_path):
    # frozen: 1025 rows (4 MiB, half of a step); rank 1 holds 1 row of it, 0.1 % of its own bytes
    out = run_ranks(run, 2, str(tmp_path / "run"), 1025, 1024, timeout=180)
    for r in out:
        assert r["restored"] == 3 and r["exact"], out
        assert r["steps"] == {0: (), 2: (0,), 3: (0,)}, out
        assert r["frozen_files"] and all(f.startswith("../step-0000000000/") for f in r["frozen_files"]), out
