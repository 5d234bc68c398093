"""``plan_reads`` finds the chunks a load needs through an array query over the chunks' bounds once a tensor has
many chunks (``load_plan.INDEX_FROM``): the reads it plans are exactly those of intersecting every chunk."""

from __future__ import annotations

import random

import pytest

from liferaft.format.records import ChunkRecord, TensorEntry
from liferaft.planning import load_plan
from liferaft.planning.load_plan import INDEX_FROM, plan_reads


def _entry(shape, cuts) -> TensorEntry:
    """A tensor tiled by the grid of ``cuts`` (per dimension, the start of each part)."""
    chunks = []
    grid = [list(zip(c, [*c[1:], n])) for c, n in zip(cuts, shape)]

    def walk(dim, offs, sizes):
        if dim == len(shape):
            n = 1
            for s in sizes:
                n *= s
            chunks.append(ChunkRecord(offsets=tuple(offs), sizes=tuple(sizes), file="f", byte_offset=len(chunks),
                                      length=n * 4, block_size=64, hashes=("0" * 8,) * max(1, -(-n * 4 // 64))))
            return
        for lo, hi in grid[dim]:
            walk(dim + 1, [*offs, lo], [*sizes, hi - lo])

    walk(0, [], [])
    return TensorEntry(key="w", path=("w",), kind="tensor", dtype="float32", shape=tuple(shape), chunks=tuple(chunks))


def _reference(entry, wanted):
    units = []
    for c in entry.chunks:                              # every chunk intersected, as before the index
        units.extend(load_plan._units_for_chunk(entry.key, c, entry.itemsize, wanted, 1 << 20))
    return units


@pytest.mark.parametrize("seed", range(20))
def test_the_index_plans_exactly_what_a_full_scan_plans(seed):
    rng = random.Random(seed)
    ndim = rng.choice([1, 2, 3])
    shape = [rng.randint(8, 40) for _ in range(ndim)]
    cuts = [sorted({0, *rng.sample(range(1, n), min(n - 1, rng.randint(1, 7)))}) for n in shape]
    entry = _entry(shape, cuts)
    wanted = []
    for target in range(rng.randint(1, 3)):
        lo = [rng.randint(0, n - 1) for n in shape]
        wanted.append((target, (tuple(lo), tuple(rng.randint(0, n - o) for o, n in zip(lo, shape)))))
    got = plan_reads(entry, wanted, max_read=1 << 20)
    assert got == _reference(entry, wanted)
    if len(entry.chunks) >= INDEX_FROM:
        assert len(load_plan._candidates(entry, wanted)) <= len(entry.chunks)


def test_many_chunks_take_the_index():
    entry = _entry([4096, 8], [list(range(0, 4096, 4)), [0]])       # 1,024 row blocks
    assert len(entry.chunks) >= INDEX_FROM
    wanted = [(0, ((1000, 0), (10, 8)))]
    assert [c.offsets for c in load_plan._candidates(entry, wanted)] == [(1000, 0), (1004, 0), (1008, 0)]
    assert plan_reads(entry, wanted) == _reference(entry, wanted)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_a_chunk_wanted_whole_is_planned_as_the_general_path_plans_it(codec):
    """``load_plan._whole_chunk`` (the shortcut of a load into the saved layout) gives the very read units the
    general path gives, for shapes of 0 to 3 dimensions, block sizes below and above the chunk, and reads limited
    below the chunk's size (the shortcut then steps aside)."""
    import itertools

    from liferaft.planning import load_plan as lp

    shortcuts = 0
    for shape, offsets in [((), ()), ((1,), (0,)), ((37,), (5,)), ((8, 3), (16, 0)), ((4, 5, 6), (0, 5, 12)),
                           ((0, 3), (0, 0))]:
        n = 1
        for d in shape:
            n *= d
        for itemsize, bs, max_read in itertools.product((1, 4), (64, 256, 4096), (128, 1 << 20)):
            nblocks = max(1, -(-n * itemsize // bs))
            chunk = ChunkRecord(offsets=offsets, sizes=shape, file="../s0/f", byte_offset=128, length=n * itemsize,
                                block_size=bs, hashes=tuple(f"h{i}" for i in range(nblocks)), codec=codec,
                                frames=None if codec is None else tuple(10 + i for i in range(nblocks)))
            general = lp._units_general("k", chunk, itemsize, [(3, (offsets, shape))], max_read)
            assert lp._units_for_chunk("k", chunk, itemsize, [(3, (offsets, shape))], max_read) == general
            whole = lp._whole_chunk("k", chunk, itemsize, 3, max_read)
            assert whole is None or [whole] == general, (shape, itemsize, bs, max_read)
            shortcuts += whole is not None
    assert shortcuts >= 40                      # (most cases take the shortcut: the comparison is not vacuous)
