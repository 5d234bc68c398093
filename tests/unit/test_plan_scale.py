"""The save planner on 16,384 simulated ranks in one process (issue #20): FSDP row shards, an FSDP × TP 8 grid,
hand-made shards held by 2 ranks, and DDP replicas of a few tensors. The plan's invariants: every element of every
tensor is written exactly once, by a rank that holds it; the bytes are balanced (no rank writes more than the
largest chunk above the mean of the ranks that hold data); a load onto 12,288 ranks finds, for its boxes, chunks
that cover them exactly. The same invariants for the plans 16,384 ranks make each on its own from compact layouts
(``planning.layouts``)."""

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


#: the layouts every rank plans on its own at 16,384 ranks (``planning.layouts``): FSDP, FSDP × TP 8, HSDP
#: (replicated over 8 groups of 2,048, sharded within each) and a plain tensor on every rank
OWN_LAYOUTS = {"fsdp": ((RANKS,), (0,)), "fsdp×tp8": ((RANKS // 8, 8), (0, 1)), "hsdp": ((8, RANKS // 8), (None, 0)),
               "plain": ((RANKS,), (None,))}


@pytest.mark.parametrize("name", OWN_LAYOUTS)
def test_16k_ranks_each_planning_on_their_own_write_every_element_once_balanced(name):
    """The union over 16,384 ranks of the plan each makes on its own (24 tensors, ragged shapes): every chunk inside
    its writer's box, the chunks of each tensor disjoint and covering it, every group of replicas balanced to one
    chunk."""
    from liferaft.planning.geometry import check_chunks_tile, numel
    from liferaft.planning.layouts import Layout, layout_box, layout_holders, plan_own
    from liferaft.planning.save_plan import TensorMeta

    layout = Layout(*OWN_LAYOUTS[name])
    tensors = [(TensorMeta(key=f"t.{i}", path=("t", str(i)), kind="tensor", dtype="bfloat16",
                           shape=(ROWS + 7 * i, 1024 + 8 * i) if name != "plain" else (512 + i, 64), boxes=()), layout)
               for i in range(24)]
    ranks = range(RANKS) if name != "plain" else range(64)      # (a plain tensor: the group is the world)
    chunks: dict[str, list] = defaultdict(list)
    loads: dict[tuple[int, ...], dict[int, int]] = {}
    for rank in ranks:
        for w in plan_own(tensors, rank, "0" * 16, 64, 4 << 20):
            t = tensors[int(w.key[2:])][0]
            assert _contains(layout_box(layout, t.shape, rank), (w.offsets, w.sizes)), (rank, w)
            chunks[w.key].append((w.offsets, w.sizes))
            group = layout_holders(layout, rank)
            loads.setdefault(group, dict.fromkeys(group, 0))[rank] += w.length
    if name == "plain":     # the first 64 ranks of the world: together they write at most 64 chunks
        assert sum(len(c) for c in chunks.values()) <= 64
        return
    for t, _ in tensors:
        assert check_chunks_tile(t.shape, chunks[t.key]) is None, t.key
        assert sum(numel(s) for _, s in chunks[t.key]) == numel(t.shape), t.key
    biggest = 4 << 20
    for group, per in loads.items():
        assert len(per) == len(group) and max(per.values()) - min(per.values()) <= biggest, group
