"""The save planner on 16,384 simulated ranks in one process (issue #20): FSDP row shards, an FSDP × TP 8 grid,
hand-made shards held by 2 ranks, and DDP replicas of a few tensors. The plan's invariants: every element of every
tensor is written exactly once, by a rank that holds it; the bytes are balanced (no rank writes more than the
largest chunk above the mean of the ranks that hold data); a load onto 12,288 ranks finds, for its boxes, chunks
that cover them exactly."""

from __future__ import annotations

from collections import defaultdict

import pytest

from liferaft.format.records import ChunkRecord, TensorEntry
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.save_plan import plan_save
from liferaft.testing.scale import COLS, LAYOUTS
from liferaft.testing.scale import rank_metas as _metas

RANKS, TENSORS, ROWS = 16_384, 3, 16_384


def _contains(outer, inner) -> bool:
    return all(o <= i and i + s <= o + z for o, z, i, s in zip(outer[0], outer[1], inner[0], inner[1]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_for_16k_ranks_writes_every_element_once_by_a_holder_balanced(layout):
    metas = _metas(layout, RANKS, TENSORS, ROWS)
    plan = plan_save(metas, "0" * 16)
    held = {m.rank: {t.key: t.boxes for t in m.tensors} for m in metas}
    written: dict[str, int] = defaultdict(int)
    for rank, items in enumerate(plan.writes):
        for w in items:
            box = (w.offsets, w.sizes)
            assert any(_contains(b, box) for b in held[rank][w.key]), (rank, w)     # a holder writes it
            n = 1
            for s in w.sizes:
                n *= s
            written[w.key] += n
    for t in plan.tensors:                           # the chunks tile the tensor (checked by the planner) and
        assert written[t.key] == t.shape[0] * t.shape[1]                           # each is written once
    loads = [plan.bytes_for_rank(r) for r in range(RANKS)]
    busy = [b for b in loads if b]
    biggest = max(w.length for items in plan.writes for w in items)
    assert max(busy) <= sum(busy) / len(busy) + biggest


def test_a_load_onto_12k_ranks_finds_exactly_its_boxes():
    metas = _metas("fsdp", RANKS, TENSORS, ROWS)
    plan = plan_save(metas, "0" * 16)
    new = RANKS * 3 // 4
    for t in plan.tensors:
        chunks = tuple(ChunkRecord(offsets=b[0], sizes=b[1], file="f", byte_offset=0, length=b[1][0] * b[1][1] * 4,
                                   block_size=1 << 30, hashes=("0" * 8,)) for b in t.boxes)
        entry = TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape, chunks=chunks)
        for r in (0, new // 2, new - 1):
            lo, hi = r * ROWS // new, (r + 1) * ROWS // new
            units = plan_reads(entry, [(0, ((lo, 0), (hi - lo, COLS)))])
            got = sum(c.sizes[0] * c.sizes[1] for u in units for c in u.copies)
            assert got == (hi - lo) * COLS
