"""``planning.layouts``: each rank's own plan from compact layouts. Its boxes are DTensor's (checked against the
computation ``state.flatten`` asks DTensor for), and the union of every rank's own plan is a valid save plan:
the same chunks ``plan_save`` cuts from the gathered metadata, each written exactly once by a rank holding it,
balanced within each group of replicas to one chunk."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard

from liferaft.format.layout import data_file_name
from liferaft.format.manifest import DTYPE_ITEMSIZE
from liferaft.planning.geometry import numel
from liferaft.planning.layouts import Layout, coordinate, layout_box, layout_holders, plan_own
from liferaft.planning.save_plan import RankMeta, TensorMeta, plan_save
from liferaft.state.flatten import _local_runs


class _Mesh:
    """What ``_local_runs`` asks of a DeviceMesh: the size of each of its dimensions."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def size(self, dim: int) -> int:
        return self.shape[dim]


def _random_layouts(rng: random.Random, count: int):
    for _ in range(count):
        mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 3])))
        ndim = rng.choice([1, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 11, 16]) for _ in range(ndim))
        shards = tuple(rng.choice([None, *range(ndim)]) for _ in mesh)
        yield Layout(mesh, shards), shape


def test_boxes_are_dtensors():
    rng = random.Random(0)
    for layout, shape in _random_layouts(rng, 300):
        placements = tuple(Replicate() if d is None else Shard(d) for d in layout.shards)
        mesh = _Mesh(layout.mesh)
        for rank in range(layout.world):
            local, runs = _local_runs(shape, mesh, placements, coordinate(layout.mesh, rank))
            offs, sizes = layout_box(layout, shape, rank)
            assert sizes == local, (layout, shape, rank)
            if numel(sizes):
                assert offs == tuple(r[0][1] for r in runs), (layout, shape, rank)


def test_holders_are_the_ranks_with_the_same_box():
    rng = random.Random(1)
    for layout, shape in _random_layouts(rng, 200):
        for rank in range(layout.world):
            holders = layout_holders(layout, rank)
            assert rank in holders and list(holders) == sorted(holders)
            box = layout_box(layout, shape, rank)
            if numel(box[1]) and all(s > 0 for s in shape):
                assert holders == tuple(r for r in range(layout.world) if layout_box(layout, shape, r) == box)


def _tensors(rng: random.Random, world: int, mesh: tuple[int, ...], count: int):
    out = []
    for i in range(count):
        shape = (rng.choice([1, 5, 64, 257]), rng.choice([1, 3, 128]))
        shards = tuple(rng.choice([None, 0, 1]) for _ in mesh)
        dtype = rng.choice(["float32", "bfloat16", "int64"])
        out.append((TensorMeta(key=f"t.{i}", path=("t", str(i)), kind="tensor", dtype=dtype, shape=shape,
                               boxes=()), Layout(mesh, shards)))
    out.append((TensorMeta(key="plain", path=("plain",), kind="tensor", dtype="float32", shape=(300, 7),
                           boxes=()), Layout((world,), (None,))))
    return out


@pytest.mark.parametrize("mesh", [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)])
def test_the_union_of_own_plans_is_a_valid_save_plan(mesh):
    rng = random.Random(hash(mesh) & 0xffff)
    world = numel(mesh)
    tensors = _tensors(rng, world, mesh, 12)
    chunk_bytes = 1024
    own = [plan_own(tensors, r, "s" * 16, 64, chunk_bytes) for r in range(world)]
    # what plan_save cuts from every rank's gathered boxes: the same chunks
    metas = [RankMeta(rank=r, tensors=tuple(
        TensorMeta(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape,
                   boxes=(layout_box(la, t.shape, r),) if numel(layout_box(la, t.shape, r)[1]) else ())
        for t, la in tensors), values=(), containers=()) for r in range(world)]
    gathered = plan_save(metas, "s" * 16, 64, chunk_bytes)
    chunks = sorted((w.key, w.offsets, w.sizes) for items in own for w in items)
    assert chunks == sorted((w.key, w.offsets, w.sizes) for items in gathered.writes for w in items)
    assert len(chunks) == len(set(chunks))
    shapes = {t.key: t.shape for t, _ in tensors}
    for key, shape in shapes.items():                  # every element exactly once
        seen = [[0] * shape[1] for _ in range(shape[0])]
        for k, offs, sizes in chunks:
            if k == key:
                for i, j in itertools.product(range(offs[0], offs[0] + sizes[0]), range(offs[1], offs[1] + sizes[1])):
                    seen[i][j] += 1
        assert all(c == 1 for row in seen for c in row), key
    layouts = {t.key: (t, la) for t, la in tensors}
    loads: dict[tuple[int, ...], dict[int, int]] = {}
    for rank, items in enumerate(own):
        end = 0
        for w in items:
            t, la = layouts[w.key]
            held = layout_box(la, t.shape, rank)
            assert all(h <= o and o + s <= h + n for o, s, h, n in zip(w.offsets, w.sizes, held[0], held[1]))
            assert w.length == numel(w.sizes) * DTYPE_ITEMSIZE[t.dtype] and w.byte_offset >= end
            assert w.byte_offset % 64 == 0 and w.file == data_file_name("s" * 16, rank)
            end = w.byte_offset + w.length
            group = layout_holders(la, rank)
            loads.setdefault(group, dict.fromkeys(group, 0))[rank] += w.length
    largest = max(w.length for items in own for w in items)
    for group, per in loads.items():                   # balanced within each group of replicas
        assert max(per.values()) - min(per.values()) <= largest, group


def test_a_rank_of_16k_plans_only_what_it_holds():
    """Rank 12,345 of 16,384 plans 50 FSDP × TP 8 tensors and 5 plain ones without looking at other ranks'."""
    world, mesh = 16384, (2048, 8)
    tensors = [(TensorMeta(key=f"w.{i}", path=("w", str(i)), kind="tensor", dtype="bfloat16", shape=(16384, 4096),
                           boxes=()), Layout(mesh, (0, 1))) for i in range(50)]
    tensors += [(TensorMeta(key=f"b.{i}", path=("b", str(i)), kind="tensor", dtype="float32", shape=(4096,),
                            boxes=()), Layout((world,), (None,))) for i in range(5)]
    mine = plan_own(tensors, 12345, "s" * 16, 64, 16 << 20)
    assert [w.key for w in mine if w.key.startswith("w")] == [f"w.{i}" for i in range(50)]
    assert all(w.sizes == (8, 512) and w.offsets == (12345 // 8 * 8, 12345 % 8 * 512) for w in mine
               if w.key.startswith("w"))
    assert sum(w.key.startswith("b") for w in mine) <= 1      # the plain ones: one chunk each, spread


def test_a_strided_layout_plans_the_boxes_each_rank_holds():
    """A ``_StridedShard`` (FSDP2 over TP): each rank's boxes are its DTensor's (two interleaved row runs here),
    held alike by its replicas; the union of the own plans writes every element once."""
    layout = Layout((2, 2), ((0, 2), None))          # strided over the first mesh dimension, replicated over the second
    assert not layout.regular
    with pytest.raises(ValueError):
        layout_box(layout, (8, 4), 0)
    runs = {0: (((0, 0), (2, 4)), ((4, 0), (2, 4))), 1: (((2, 0), (2, 4)), ((6, 0), (2, 4)))}
    own = []
    for rank in range(4):
        c = coordinate(layout.mesh, rank)
        t = TensorMeta(key="w", path=("w",), kind="tensor", dtype="float32", shape=(8, 4), boxes=runs[c[0]])
        own.append(plan_own([(t, layout)], rank, "s" * 16, 64, 1 << 20))
        assert layout_holders(layout, rank) == ((0, 1) if c[0] == 0 else (2, 3))
    chunks = sorted((w.offsets, w.sizes) for items in own for w in items)
    assert chunks == sorted(b for r in runs.values() for b in r)
    assert all(len(items) == 1 for items in own)     # two boxes per group, one to each member


def test_the_commit_refuses_own_plans_that_do_not_tile():
    from liferaft.core.phases import _check_tiles
    from liferaft.errors import InvalidStateError
    from liferaft.planning.save_plan import SavePlan, WriteItem

    t = TensorMeta(key="w", path=("w",), kind="tensor", dtype="float32", shape=(4, 2), boxes=())

    def plan(*boxes):
        writes = tuple((WriteItem(key="w", offsets=o, sizes=s, file="f", byte_offset=0, length=numel(s) * 4),)
                       for o, s in boxes)
        return SavePlan(world_size=len(writes), writes=writes, files={}, tensors=(t,), values=(), containers=(),
                        own=True)

    _check_tiles(plan(((0, 0), (2, 2)), ((2, 0), (2, 2))))
    for bad in (plan(((0, 0), (2, 2)), ((1, 0), (2, 2))),          # overlapping
                plan(((0, 0), (2, 2)), ((2, 0), (1, 2)))):         # a row missing
        with pytest.raises(InvalidStateError, match="'w'"):
            _check_tiles(bad)
    stray = SavePlan(world_size=1, writes=((WriteItem(key="x", offsets=(0,), sizes=(1,), file="f", byte_offset=0,
                                                      length=4),),), files={}, tensors=(t,), values=(),
                     containers=(), own=True)
    with pytest.raises(InvalidStateError, match="'x'"):
        _check_tiles(stray)
