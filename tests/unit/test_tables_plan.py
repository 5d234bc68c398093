"""Chunk tables (format version 4, docs/FORMAT.md §4.6), the pure parts: a table's encoding and its checks
against the index, and how a reader finds the tables it needs from the index alone: the boxes of a layout that
overlap a wanted box (grid arithmetic, equal to trying every rank) and the member of a group of replicas each
chunk was given to (equal to the save's own plans), at 16k simulated ranks reading a few tables."""

from __future__ import annotations

import random

import pytest

from liferaft.core.tabled import TableSource
from liferaft.errors import CorruptCheckpointError
from liferaft.format.layout import data_file_name, table_file_name
from liferaft.format.manifest import DTYPE_ITEMSIZE, ChunkRecord, Manifest, TableRef, TensorEntry
from liferaft.format.tables import decode_table, encode_table
from liferaft.planning.geometry import intersect, numel
from liferaft.planning.layouts import Layout, group_writers, layout_box, layout_holders, overlapping, plan_own
from liferaft.planning.save_plan import TensorMeta


def _random_case(rng: random.Random):
    mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 3])))
    ndim = rng.choice([0, 1, 2, 3])
    shape = tuple(rng.choice([1, 2, 3, 5, 7, 11, 16]) for _ in range(ndim))
    shards = tuple(rng.choice([None, *range(ndim)]) for _ in mesh)
    offs = tuple(rng.randrange(s) for s in shape)
    box = offs, tuple(rng.randint(0, s - o) for s, o in zip(shape, offs))
    return Layout(mesh, shards), shape, box


def test_the_boxes_overlapping_a_box_are_those_found_by_trying_every_rank():
    rng = random.Random(7)
    for _ in range(3000):
        layout, shape, box = _random_case(rng)
        want: dict = {}
        for r in range(layout.world):
            held = layout_box(layout, shape, r)
            if numel(held[1]) and numel(box[1]) and intersect(held, box) is not None:
                want.setdefault(held, set()).add(r)
        got = overlapping(layout, shape, box)
        assert len(got) == len(want) and {b for b, _ in got} == set(want), (layout, shape, box)
        for held, member in got:
            assert member in want[held] and member == min(layout_holders(layout, member))


def test_the_writer_of_every_chunk_replayed_from_the_index_is_the_rank_whose_own_plan_wrote_it():
    rng = random.Random(3)
    for _ in range(60):
        mesh = tuple(rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 2])))
        tensors = []
        for i in range(rng.randint(1, 6)):
            ndim = rng.choice([1, 2])
            shape = tuple(rng.choice([1, 3, 40, 300]) for _ in range(ndim))
            shards = tuple(rng.choice([None, *range(ndim)]) for _ in mesh)
            tensors.append((TensorMeta(f"t{i}", (f"t{i}",), "tensor", "float32", shape, ()), Layout(mesh, shards)))
        world, chunk = tensors[0][1].world, rng.choice([64, 256, 4096])
        written = {}
        for r in range(world):
            for w in plan_own(tensors, r, "s", 64, chunk):
                pos = next(i for i, (t, _) in enumerate(tensors) if t.key == w.key)
                assert (pos, (w.offsets, w.sizes)) not in written
                written[(pos, (w.offsets, w.sizes))] = r
        for r in range(world):
            for members, writers in group_writers(tensors, r, chunk).items():
                assert r in members
                for job, writer in writers.items():
                    assert written[job] == writer


def _index(world: int, tensors: list[tuple[str, tuple[int, ...], Layout]], chunk: int) -> Manifest:
    entries = tuple(TensorEntry(key=k, path=(k,), kind="tensor", dtype="float32", shape=s, chunks=(),
                                layout=(la.mesh, la.shards)) for k, s, la in tensors)  # type: ignore[arg-type]
    refs = tuple(TableRef(file=table_file_name("s", r), rank=r, hash="0" * 16, chunks=0) for r in range(world))
    return Manifest(save_id="s", world_size=world, created_unix=0.0, liferaft_version="", torch_version="",
                    files={}, tensors=entries, values=(), containers=(), version=4, tables=refs,
                    planned={"alignment": 64, "chunk_bytes": chunk})


@pytest.mark.parametrize("world,new", [(16384, 12288), (16384, 16384)])
def test_a_rank_of_a_resharded_fsdp_load_at_16k_ranks_needs_two_or_three_tables(world, new):
    """FSDP over 16,384 ranks, loaded over 12,288: each loading rank's rows span at most three saved boxes."""
    tensors = [(f"layer{i}", (16384 * 8, 1024 * (i + 1)), Layout((world,), (0,))) for i in range(20)]
    src = TableSource(None, _index(world, tensors, 16 << 20), None)       # type: ignore[arg-type]
    for rank in (0, 1, new // 2, new - 1):
        need: set[int] = set()
        for key, shape, _ in tensors:
            lo, hi = rank * shape[0] // new, (rank + 1) * shape[0] // new
            need |= src.writers(key, ((lo, 0), (hi - lo, shape[1])))
        assert 1 <= len(need) <= (1 if new == world else 3), need
        assert all(abs(w - rank * world // new) <= 2 for w in need)


def test_the_chunks_of_a_tensor_every_rank_holds_whole_are_in_the_index_not_in_tables():
    """DDP over 16,384 ranks: a 96 MiB tensor is 6 chunks written by 6 members; every loading rank needs them
    all, so the index lists them and a load reads no table for it; a sharded tensor's chunks come from tables."""
    world = 16384
    tensors = [("w", (6 * 4096, 1024), Layout((world,), (None,))), ("s", (world, 8), Layout((world,), (0,)))]
    src = TableSource(None, _index(world, tensors, 16 << 20), None)       # type: ignore[arg-type]
    assert src.writers("w", ((0, 0), (6 * 4096, 1024))) == set()
    assert src.writers("s", ((5, 0), (2, 8))) == {5, 6}


def _chunk(offsets, sizes, rank=0, save_id="s") -> ChunkRecord:
    n = numel(sizes) * 4
    return ChunkRecord(offsets=offsets, sizes=sizes, file=data_file_name(save_id, rank), byte_offset=0, length=n,
                       block_size=n, hashes=("00000000",))


def test_a_table_round_trips_and_its_damage_is_refused_naming_it():
    la = Layout((2,), (0,))
    index = _index(2, [("a", (4, 3), la)], 1 << 20)
    index = Manifest(**{**index.__dict__, "files": {data_file_name("s", 0): 1024, table_file_name("s", 0): 10}})
    ref = TableRef(file=table_file_name("s", 0), rank=0, hash="0" * 16, chunks=1)
    data = encode_table("s", 0, [(0, _chunk((0, 0), (2, 3)))])
    assert decode_table(data, ref, index) == [(0, _chunk((0, 0), (2, 3)))]
    bad = {
        "another rank": encode_table("s", 1, [(0, _chunk((0, 0), (2, 3)))]),
        "another save": encode_table("t", 0, [(0, _chunk((0, 0), (2, 3)))]),
        "a tensor not in the index": encode_table("s", 0, [(1, _chunk((0, 0), (2, 3)))]),
        "another rank's file": encode_table("s", 0, [(0, _chunk((0, 0), (2, 3), rank=1))]),
        "a chunk beyond its file": encode_table("s", 0, [(0, _chunk((0, 0), (2, 3)).__class__(
            **{**_chunk((0, 0), (2, 3)).__dict__, "byte_offset": 1020}))]),
        "more chunks than the index says": encode_table("s", 0, [(0, _chunk((0, 0), (2, 3)))] * 2),
        "not JSON": b"\xff" * 8,
    }
    for what, data in bad.items():
        with pytest.raises(CorruptCheckpointError, match="r00000-chunks.json"):
            decode_table(data, ref, index)
        assert what
    assert DTYPE_ITEMSIZE["float32"] == 4


class _Mesh:
    """What ``state.flatten._local_runs`` asks of a DeviceMesh: the size of each of its dimensions."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def size(self, dim: int) -> int:
        return self.shape[dim]


def test_fsdp2_over_tp_split_evenly_is_a_nested_split_tp_first_equal_to_dtensors_boxes():
    """``as_ordered``: a ``_StridedShard(d, sf)`` followed by ``Shard(d)`` over ``sf`` ranks, with ``sf`` dividing
    the extent, holds exactly the rows of splitting by the later mesh dimension first (DTensor's own boxes, from
    ``_local_runs``, for every rank of random 2-D and 3-D meshes with replicated and other sharded dimensions);
    the grid arithmetic over the reordered layout finds the same boxes as trying every rank."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from liferaft.planning.layouts import as_ordered, coordinate
    from liferaft.state.flatten import _local_runs

    rng = random.Random(5)
    converted = 0
    for _ in range(400):
        k = rng.choice([2, 3])
        mesh = tuple(rng.randint(1, 4) for _ in range(k))
        ndim = rng.choice([1, 2])
        shape = tuple(rng.randint(1, 24) for _ in range(ndim))
        a = rng.randrange(k - 1)
        b = rng.randrange(a + 1, k)
        d = rng.randrange(ndim)
        places, shards = [], []
        for i in range(k):
            other = [x for x in range(ndim) if x != d]
            if i == a:
                places.append(_StridedShard(d, split_factor=mesh[b]))
                shards.append((d, mesh[b]))
            elif i == b:
                places.append(Shard(d))
                shards.append(d)
            elif other and rng.random() < 0.5:
                places.append(Shard(other[0]))
                shards.append(other[0])
            else:
                places.append(Replicate())
                shards.append(None)
        ordered = as_ordered(Layout(mesh, tuple(shards)), shape)
        if ordered is None:
            assert shape[d] % mesh[b]
            continue
        converted += 1
        for rank in range(numel(mesh)):
            _, runs = _local_runs(shape, _Mesh(mesh), tuple(places), coordinate(mesh, rank))
            boxes = [(tuple(r[1] for r in combo), tuple(r[2] for r in combo)) for combo in itertools.product(*runs)]
            boxes = [b_ for b_ in boxes if numel(b_[1])]
            want = layout_box(ordered, shape, rank)
            assert boxes == ([want] if numel(want[1]) else []), (mesh, shards, shape, rank, boxes, want)
        box = (tuple(rng.randrange(s) for s in shape), tuple(1 for _ in shape))
        found = {held for held, _ in overlapping(ordered, shape, box)}
        assert found == {layout_box(ordered, shape, r) for r in range(numel(mesh))
                         if numel(layout_box(ordered, shape, r)[1]) and intersect(layout_box(ordered, shape, r), box)}
    assert converted > 100


def test_a_version_6_table_may_name_its_ranks_copies_and_listed_files_of_other_checkpoints_only():
    from dataclasses import replace

    from liferaft.format.layout import copies_file_name

    la = Layout((2,), (0,))
    base = _index(2, [("a", (4, 3), la)], 1 << 20)
    files = {data_file_name("s", 0): 1024, copies_file_name("s", 0): 1024, copies_file_name("s", 1): 1024,
             "../old/data/x/r00000.bin": 1024, table_file_name("s", 0): 10}
    ref = TableRef(file=table_file_name("s", 0), rank=0, hash="0" * 16, chunks=1)

    def table(file: str) -> bytes:
        return encode_table("s", 0, [(0, replace(_chunk((0, 0), (2, 3)), file=file))])

    v6 = replace(base, files=files, version=6)
    for ok in (copies_file_name("s", 0), "../old/data/x/r00000.bin", data_file_name("s", 0)):
        assert decode_table(table(ok), ref, v6)[0][1].file == ok
    refused = {
        "another rank's copies": (v6, copies_file_name("s", 1)),
        "an unlisted file of another checkpoint": (v6, "../old/data/x/r00001.bin"),
        "a reference in version 5": (replace(v6, version=5), "../old/data/x/r00000.bin"),
        "copies in version 5": (replace(v6, version=5), copies_file_name("s", 0)),
    }
    for what, (index, file) in refused.items():
        with pytest.raises(CorruptCheckpointError, match="r00000-chunks.json"):
            decode_table(table(file), ref, index)
        assert what


def test_an_index_of_version_5_listing_another_checkpoints_file_is_refused():
    import json
    from dataclasses import replace

    from liferaft.format.manifest import decode_manifest

    la = Layout((2,), (0,))
    index = _index(2, [("a", (4, 3), la)], 1 << 20)
    index = Manifest(**{**index.__dict__, "tables": (), "files": {"../old/data/x/r00000.bin": 64}, "version": 6,
                        "tensors": tuple(replace(t, layout=(*t.layout, None, None)) for t in index.tensors)})
    doc = json.loads(index.to_json_bytes())
    assert doc["version"] == 6
    decode_manifest(json.dumps(doc).encode())
    doc["version"] = 5
    with pytest.raises(CorruptCheckpointError, match="need format version 6"):
        decode_manifest(json.dumps(doc).encode())


def test_each_rank_is_sent_its_table_and_the_files_bearing_its_number():
    from dataclasses import replace

    from liferaft.core.base import shared_base, split_base

    la = Layout((4,), (0,))
    index = _index(4, [("a", (8, 3), la)], 1 << 20)
    files = {table_file_name("s", r): 10 for r in range(4)}
    files.update({data_file_name("s", r): 100 + r for r in range(4)})
    files.update({"../old/data/x/r00002.bin": 7, "../old/data/x/r00002-copies.bin": 8,
                  "../old/data/x/r100001.bin": 9})
    index = replace(index, files=files)
    parts = split_base(("b", index), 3)
    assert [p[0].rank if p[0] else None for p in parts] == [0, 1, 2]
    assert parts[2][1] == {table_file_name("s", 2): 10, data_file_name("s", 2): 102,
                           "../old/data/x/r00002.bin": 7, "../old/data/x/r00002-copies.bin": 8}
    assert all("r100001" not in f for p in parts for f in p[1])
    shared = shared_base(("b", index))
    assert shared is not None and shared.siblings == ("b", "old") and shared.index.files == {}
