"""Planning as pure functions, for many ranks, inside one process."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from liferaft.codecs.checksum import block_hashes
from liferaft.core.chunks.writer import StoredChunk
from liferaft.errors import InvalidStateError
from liferaft.format.manifest import ChunkRecord, TensorEntry
from liferaft.planning.geometry import byte_span, check_chunks_tile, split_box, split_for_reading
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.save_plan import RankMeta, TensorMeta, ValueMeta, build_manifest, plan_save, replan


def shard_boxes(shape, grid):
    """torch.chunk-style boxes of ``shape`` split by ``grid`` (parts per dim); may contain empty boxes."""
    per_dim = []
    for n, parts in zip(shape, grid):
        step = -(-n // parts)
        per_dim.append([(min(i * step, n), max(0, min(step, n - i * step))) for i in range(parts)])
    return [(tuple(o for o, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*per_dim)]


def meta(rank, tensors):
    return RankMeta(rank=rank, tensors=tuple(tensors), values=(), containers=())


def tmeta(key, shape, boxes, dtype="float32"):
    return TensorMeta(key=key, path=(key,), kind="tensor", dtype=dtype, shape=tuple(shape), boxes=tuple(boxes))


def test_replicated_tensors_written_once_and_balanced_over_64_ranks():
    world = 64
    rng = random.Random(0)
    shapes = [(rng.randint(1, 300), rng.randint(1, 40)) for _ in range(500)]
    full = lambda s: ((0, 0), s)
    metas = [meta(r, [tmeta(f"t{i}", s, [full(s)]) for i, s in enumerate(shapes)]) for r in range(world)]
    plan = plan_save(metas, "id")
    written = [w.key for ws in plan.writes for w in ws]
    assert sorted(written) == sorted(f"t{i}" for i in range(len(shapes)))     # once each
    loads = [plan.bytes_for_rank(r) for r in range(world)]
    biggest = max(s[0] * s[1] * 4 for s in shapes)
    assert max(loads) - min(loads) <= biggest                                   # LPT balance bound
    assert min(loads) > 0                                                      # nobody idle, not all on rank 0


def test_replan_equals_a_fresh_plan_for_the_same_tensors():
    tensors = [[tmeta("a", (8, 4), [((4 * r, 0), (4, 4))]), tmeta("b", (300,), [((0,), (300,))])] for r in range(2)]

    def metas(step):
        return [RankMeta(rank=r, tensors=tuple(tensors[r]), containers=(),
                         values=(ValueMeta(key="step", path=("step",), encoded=step, digest=str(step)),
                                 ValueMeta(key="r", path=("r",), encoded=r + step, digest=str(r + step))))
                for r in range(2)]

    first = plan_save(metas(1), "id1")
    again = replan(first, metas(2), "id2")
    assert again == plan_save(metas(2), "id2")
    assert all(w.file.startswith("data/id2/") for ws in again.writes for w in ws) and set(again.files) == \
        {"data/id2/r00000.bin", "data/id2/r00001.bin"}


def test_sharded_2d_uneven_64_ranks_each_rank_writes_own_chunk():
    shape = (1001, 77)
    boxes = shard_boxes(shape, (8, 8))
    metas = [meta(r, [tmeta("w", shape, [boxes[r]])]) for r in range(64)]
    plan = plan_save(metas, "id")
    for r in range(64):
        got = [(w.offsets, w.sizes) for w in plan.writes[r]]
        assert got == ([boxes[r]] if boxes[r][1][0] * boxes[r][1][1] else [])
    for ws in plan.writes:
        for a, b in itertools.pairwise(ws):
            assert b.byte_offset >= a.byte_offset + a.length and b.byte_offset % 64 == 0


def test_partial_replicas_written_once():
    # 2-D mesh 4 (replicate) x 16 (shard): each shard held by 4 ranks
    shape = (160, 3)
    boxes = shard_boxes(shape, (16, 1))
    metas = [meta(r, [tmeta("w", shape, [boxes[r % 16]])]) for r in range(64)]
    plan = plan_save(metas, "id")
    written = sorted((w.offsets, w.sizes) for ws in plan.writes for w in ws)
    assert written == sorted(boxes)
    assert sum(1 for ws in plan.writes if ws) == 16


@pytest.mark.parametrize("boxes, msg", [
    ([((0,), (6,)), ((5,), (5,))], "overlap"),
    ([((0,), (4,)), ((5,), (5,))], "cover 9 of 10"),
    ([((0,), (4,)), ((4,), (7,))], "outside"),
])
def test_bad_shards_rejected(boxes, msg):
    metas = [meta(r, [tmeta("w", (10,), [b])]) for r, b in enumerate(boxes)]
    with pytest.raises(InvalidStateError, match=msg) as e:
        plan_save(metas, "id")
    assert "'w'" in str(e.value)


def test_inconsistent_global_shape_rejected():
    metas = [meta(0, [tmeta("w", (10,), [((0,), (10,))])]), meta(1, [tmeta("w", (11,), [((0,), (11,))])])]
    with pytest.raises(InvalidStateError, match="rank 1 holds global shape"):
        plan_save(metas, "id")


def test_tiling_check_scales_to_thousands_of_chunks():
    boxes = shard_boxes((4096, 8), (4096, 1))
    assert check_chunks_tile((4096, 8), boxes) is None
    boxes2 = boxes[:-1] + [((4094,), (2,))]
    boxes2 = [((o[0], 0), (s[0], 8)) if len(o) == 1 else (o, s) for o, s in boxes2]
    assert "overlap" in check_chunks_tile((4096, 8), boxes2)


# ----------------------------------------------------------------------------------------- load planning


def saved_entry(global_t: torch.Tensor, boxes, block_size):
    """Lay the chunks of ``global_t`` out in one bytes 'file' the way a save would; return (entry, file bytes)."""
    data = bytearray()
    chunks = []
    isz = global_t.element_size()
    for off, size in boxes:
        if 0 in size:
            continue
        piece = global_t[tuple(slice(o, o + s) for o, s in zip(off, size))].contiguous()
        raw = piece.reshape(-1).view(torch.uint8).numpy().tobytes()
        pos = -(-len(data) // 64) * 64
        data.extend(b"\0" * (pos - len(data)))
        data.extend(raw)
        chunks.append(ChunkRecord(offsets=off, sizes=size, file="f", byte_offset=pos, length=len(raw),
                                  block_size=block_size, hashes=tuple(block_hashes(memoryview(raw), block_size))))
        assert len(raw) == piece.numel() * isz
    entry = TensorEntry(key="w", path=("w",), kind="tensor", dtype=str(global_t.dtype)[6:], shape=tuple(global_t.shape),
                        chunks=tuple(chunks))
    return entry, bytes(data)


def run_units(units, data, target_boxes, dtype):
    targets = [torch.full(b[1], -1, dtype=dtype) for b in target_boxes]
    nread = 0
    for u in units:
        buf = torch.frombuffer(bytearray(data[u.file_offset:u.file_offset + u.length]), dtype=torch.uint8)
        assert u.length % u.block_size == 0 or u.file_offset + u.length <= len(data)
        assert len(u.hashes) == -(-u.length // u.block_size)
        nread += u.length
        flat = buf.view(dtype)
        for c in u.copies:
            dst = targets[c.target]
            for d, (o, s) in enumerate(zip(c.dest_offsets, c.sizes)):
                dst = dst.narrow(d, o, s)
            dst.copy_(torch.as_strided(flat, c.sizes, c.src_strides, c.src_offset))
    return targets, nread


@pytest.mark.parametrize("shape, save_grid, load_grid", [
    ((64, 48), (2, 1), (1, 3)),
    ((7,), (3,), (2,)),
    ((9, 10, 11), (2, 2, 1), (1, 3, 4)),
    ((1000, 300), (5, 1), (3, 1)),
    ((50, 4000), (1, 4), (4, 1)),
    ((), (), ()),
])
@pytest.mark.parametrize("block", [256, 4096])
def test_plan_reads_reassembles_exactly(shape, save_grid, load_grid, block):
    g = torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float32).reshape(shape)
    entry, data = saved_entry(g, shard_boxes(shape, save_grid), block)
    for tb in shard_boxes(shape, load_grid):
        if 0 in tb[1]:
            continue
        units = plan_reads(entry, [(0, tb)], max_read=8 * block)
        (got,), nread = run_units(units, data, [tb], torch.float32)
        want = g[tuple(slice(o, o + s) for o, s in zip(*tb))]
        assert torch.equal(got, want)
        for u in units:   # no read larger than max_read, always whole blocks of one chunk
            assert u.length <= 8 * block


def test_resharding_read_fetches_only_needed_blocks():
    # rows 0..999 saved as one chunk; load rows 500..549: reads must stay near 50 rows, not the whole chunk
    g = torch.arange(1000 * 256, dtype=torch.float32).reshape(1000, 256)
    entry, data = saved_entry(g, [((0, 0), (1000, 256))], 4096)
    tb = ((500, 0), (50, 256))
    units = plan_reads(entry, [(0, tb)])
    _, nread = run_units(units, data, [tb], torch.float32)
    assert nread <= 50 * 256 * 4 + 2 * 4096


def test_column_slice_of_wide_rows_reads_per_row():
    # rows of 1 MiB, want 16 columns: must not read the whole 64 MiB span
    g = torch.zeros(64, 262144, dtype=torch.float32)
    entry, data = saved_entry(g, [((0, 0), (64, 262144))], 65536)
    units = plan_reads(entry, [(0, ((0, 1000), (64, 16)))])
    assert sum(u.length for u in units) <= 64 * 65536 * 2


def test_split_for_reading_pieces_cover_box_exactly():
    chunk = (40, 30, 20)
    box = ((3, 5, 2), (30, 20, 10))
    pieces = split_for_reading(box, chunk, 4, block=512, max_read=4096)
    seen = set()
    for off, size in pieces:
        lo, hi = byte_span((off, size), chunk, 4)
        assert hi - lo <= 4096 or size.count(1) >= 2
        for idx in itertools.product(*[range(o, o + s) for o, s in zip(off, size)]):
            assert idx not in seen
            seen.add(idx)
    assert len(seen) == 30 * 20 * 10


def test_build_manifest_records_every_chunk():
    shape = (10, 4)
    boxes = shard_boxes(shape, (3, 1))
    metas = [meta(r, [tmeta("w", shape, [boxes[r]])]) for r in range(3)]
    plan = plan_save(metas, "abc")
    stored = [[StoredChunk(file=w.file, byte_offset=w.byte_offset, block_size=1 << 20, hashes=("h",))
               for w in plan.writes[r]] for r in range(3)]
    m = build_manifest(plan, stored, [64, 64, 64], save_id="abc", created_unix=0.0, liferaft_version="x",
                       torch_version="y")
    assert [c.offsets for c in m.tensors[0].chunks] == [(0, 0), (4, 0), (8, 0)]
    assert set(m.files) == {f"data/abc/r{r:05d}.bin" for r in range(3)}


def test_large_boxes_are_cut_into_row_runs_that_tile_them():
    shape = (1000, 300)                       # 1.2 MB of float32 per rank half
    boxes = shard_boxes(shape, (2, 1))
    metas = [meta(r, [tmeta("w", shape, [boxes[r]])]) for r in range(2)]
    plan = plan_save(metas, "abc", chunk_bytes=100 * 300 * 4)
    for r in range(2):
        assert len(plan.writes[r]) == 5 and all(w.length == 100 * 300 * 4 for w in plan.writes[r])
        assert all(w.parent == boxes[r] for w in plan.writes[r])
    got = sorted((w.offsets, w.sizes) for r in range(2) for w in plan.writes[r])
    assert check_chunks_tile(shape, got) is None


def test_split_box_cuts_rows_then_within_a_row():
    assert split_box(((0, 0), (4, 10)), 4, 80) == [((r, 0), (2, 10)) for r in (0, 2)]
    sub = split_box(((2, 5), (2, 10)), 4, 16)      # a row of 40 bytes > 16: parts of each row
    assert sub[:3] == [((2, 5), (1, 4)), ((2, 9), (1, 4)), ((2, 13), (1, 2))] and len(sub) == 6
    assert check_chunks_tile((4, 15), sub + [((0, 0), (2, 15)), ((2, 0), (2, 5))]) is None
    assert split_box(((0,), (10,)), 8, 24) == [((0,), (3,)), ((3,), (3,)), ((6,), (3,)), ((9,), (1,))]
    assert split_box(((), ()), 4, 1) == [((), ())]
