"""planning.share_plan.plan_sharing with ``holders``: files only some ranks can read (a memory tier's node-local
copies) are read by a holder and sent to the ranks that need them, whatever the span's length."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liferaft.errors import CorruptCheckpointError
from liferaft.planning.share_plan import plan_sharing


def test_a_span_only_a_peer_holds_is_read_there_and_sent_even_when_small():
    spans = [[("a", 0, 100)], [("b", 0, 10)]]           # rank 0 holds a and b, rank 1 nothing
    got = plan_sharing(spans, holders={"a": [0], "b": [0]})
    assert set(got) == {("b", 0, 10)}                    # a: rank 0 reads its own span; b: read for rank 1
    s = got[("b", 0, 10)]
    assert s.reader == 0 and s.receivers == (1,) and (s.start, s.length) == (0, 10)


def test_a_needer_that_holds_the_file_reads_it_for_the_others():
    spans = [[], [("f", 0, 5)], [("f", 0, 5)]]
    got = plan_sharing(spans, holders={"f": [0, 2]})
    assert got[("f", 0, 5)].reader == 2 and got[("f", 0, 5)].receivers == (1,)


def test_holders_share_the_reading_by_bytes_assigned():
    spans = [[], [], [(f"f{i}", 0, 1 << 20) for i in range(4)]]
    got = plan_sharing(spans, holders={f"f{i}": [0, 1] for i in range(4)})
    assert [got[(f"f{i}", 0, 1 << 20)].reader for i in range(4)] == [0, 1, 0, 1]
    assert [got[(f"f{i}", 0, 1 << 20)].tag for i in range(4)] == [0, 1, 2, 3]


def test_a_span_no_rank_holds_is_refused_naming_the_file():
    with pytest.raises(CorruptCheckpointError, match="'lost'"):
        plan_sharing([[("lost", 0, 8)]], holders={"lost": []})


def test_without_holders_the_plan_is_unchanged():
    spans = [[("f", 0, 2 << 20), ("g", 0, 10)], [("f", 0, 2 << 20), ("g", 0, 10)]]
    got = plan_sharing(spans)
    assert set(got) == {("f", 0, 2 << 20)} and got[("f", 0, 2 << 20)].reader == 0


@given(st.lists(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(1, 3)), max_size=4),
                min_size=1, max_size=4),
       st.dictionaries(st.sampled_from("abc"), st.lists(st.integers(0, 3), min_size=1, max_size=3)))
def test_every_needed_span_of_a_file_a_rank_cannot_read_reaches_it_from_a_holder(spans, holders):
    holders = {f: [r for r in rs if r < len(spans)] or [0] for f, rs in holders.items()}
    got = plan_sharing(spans, holders=holders)
    tags = sorted(s.tag for s in got.values())
    assert tags == list(range(len(got)))
    for rank, mine in enumerate(spans):
        for span in mine:
            if span[0] in holders and rank not in holders[span[0]]:
                s = got[span]
                assert rank in s.receivers and s.reader in holders[span[0]] and s.reader not in s.receivers
