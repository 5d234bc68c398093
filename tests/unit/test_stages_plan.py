"""Save planning for ranks that hold different tensors (pipeline stages, ``planning.stages``), the pure parts:
classes of ranks, a layout scoped to the ranks holding it (``at`` for a slice of the mesh, ``group`` for a tensor
held whole), the merge rank 0 makes and what it refuses; and, over random pipeline × data × tensor-parallel
meshes, the plans every rank makes on its own: every element written exactly once, by a rank holding it, and
every chunk's writer found again by a reader's replay from the index (which records ``at``, not ``group``)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from liferaft.format.manifest import DTYPE_ITEMSIZE
from liferaft.format.records import ContainerEntry
from liferaft.planning.geometry import check_chunks_tile, numel
from liferaft.planning.layouts import Layout, group_writers, holds, layout_box, layout_holders, overlapping, plan_own
from liferaft.planning.save_plan import TensorMeta
from liferaft.planning.stages import MAX_CLASSES, Staged, classes_of, merge_stages, scoped, stage_layouts


def _meta(key: str, shape: tuple[int, ...]) -> TensorMeta:
    return TensorMeta(key, (key,), "tensor", "float32", shape, ())


def test_ranks_fall_into_classes_numbered_by_their_first_rank():
    class_of, firsts = classes_of([9, 9, 4, 4, 9, 7])
    assert class_of.tolist() == [0, 0, 1, 1, 0, 2] and firsts == [0, 2, 5]
    assert MAX_CLASSES >= 64


def test_a_layout_is_scoped_to_a_slice_a_group_or_refused():
    layout = Layout((2, 4), (None, 0))                      # a stage's FSDP over the root (pp, dp) mesh
    assert scoped(layout, np.arange(4, 8)) == replace(layout, at=(1, None))
    assert scoped(layout, np.arange(8)) == layout           # every stage holds it: unchanged
    assert scoped(layout, np.array([0, 1, 4, 5])) is None   # no slice of the mesh
    whole = Layout((8,), (None,))
    assert scoped(whole, np.array([2, 3])) == replace(whole, group=(2, 3))
    assert scoped(whole, np.array([5])) == replace(whole, group=(5,))
    replicas = Layout((2, 4), (None, None))                 # a stage's DTensor replicated: held whole, a group
    assert scoped(replicas, np.arange(4, 8)) == replace(replicas, group=(4, 5, 6, 7))
    assert scoped(Layout((1, 8), (0, None)), np.arange(8)) is None     # sharded by a mesh dimension of 1 rank
    grid = Layout((2, 2, 2), (None, 0, None))               # (pp, dp, tp): TP replicates within the stage
    s = scoped(grid, np.arange(4))
    assert s == replace(grid, at=(0, None, None))
    assert layout_holders(s, 1) == (0, 1) and not holds(s, 5) and numel(layout_box(s, (6, 3), 5)[1]) == 0
    assert [r for _, r in overlapping(s, (6, 3), ((0, 0), (6, 3)))] == [0, 2]


def _desc(names, layout, containers=()):
    return tuple(_meta(n, (8, 4)) for n in names), tuple(layout for _ in names), containers, (64, 1 << 20, True)


def test_the_merge_lists_every_stage_and_refuses_what_it_cannot_scope():
    class_of = np.array([0, 0, 1, 1])
    lay = Layout((2, 2), (None, 0))
    merged = merge_stages([_desc(["a", "b"], lay), _desc(["c"], lay)], class_of)
    assert isinstance(merged, Staged) and [t.key for t in merged.tensors] == ["a", "b", "c"]
    assert merged.classes == ((0,), (0,), (1,))
    assert [la.at for la in stage_layouts(merged, class_of)] == [(0, None), (0, None), (1, None)]
    other = Layout((2, 2), (0, None))
    assert "describe it differently" in merge_stages([_desc(["a"], lay), _desc(["a"], other)], class_of)
    d = list(_desc(["c"], lay))
    d[3] = (64, 2 << 20, True)
    assert "different save options" in merge_stages([_desc(["a"], lay), tuple(d)], class_of)
    # a tensor held by ranks 0-2 of a (3, 2) mesh (classes 0 and 1): no slice of it
    grid = Layout((3, 2), (None, 0))
    assert "no slice" in merge_stages([_desc(["x"], grid), _desc(["x"], grid), _desc(["y"], grid)],
                                      np.array([0, 1, 1, 2, 2, 2]))
    conflict = merge_stages([_desc(["a"], lay, (ContainerEntry(("opt",), "dict"),)),
                             _desc(["c"], lay, (ContainerEntry(("opt",), "list"),))], class_of)
    assert isinstance(conflict, str) and "holds a list where another rank holds a dict" in conflict


def _random_job(rng: random.Random):
    """A random (pp, dp, tp) root mesh; each stage holds its own tensors, some sharded over dp or dp × tp, some
    replicated over tp, some plain (held whole by the stage), plus one tensor every rank holds."""
    pp, dp, tp = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2])
    mesh, world = (pp, dp, tp), pp * dp * tp
    descs, class_of = [], np.repeat(np.arange(pp), dp * tp).astype(np.int32)
    for s in range(pp):
        metas, lays = [_meta("shared", (5,))], [Layout((world,), (None,))]
        for i in range(rng.randint(1, 4)):
            shape = (rng.choice([1, 7, 40, 129]), rng.choice([3, 33]))
            kind = rng.choice(["fsdp", "fsdp_tp", "tp_rep", "plain"])
            la = {"fsdp": Layout(mesh, (None, 0, None)), "fsdp_tp": Layout(mesh, (None, 0, 1)),
                  "tp_rep": Layout(mesh, (None, None, None)), "plain": Layout((world,), (None,))}[kind]
            if kind == "fsdp" and dp == 1 and tp == 1:
                la = Layout((world,), (None,))
            metas.append(_meta(f"s{s}.t{i}", shape))
            lays.append(la)
        descs.append((tuple(metas), tuple(lays), (), (64, 1 << 20, True)))
    return world, descs, class_of


def test_stage_plans_write_every_element_once_and_a_reader_replays_each_writer():
    rng = random.Random(11)
    done = 0
    for _ in range(80):
        world, descs, class_of = _random_job(rng)
        merged = merge_stages(descs, class_of)
        if isinstance(merged, str):
            assert "mesh dimension of 1 rank" in merged or "no slice" in merged
            continue
        done += 1
        layouts = stage_layouts(merged, class_of)
        tensors = list(zip(merged.tensors, layouts))
        chunk = rng.choice([64, 256, 4096])
        written: dict[str, list] = {t.key: [] for t in merged.tensors}
        by_rank = {}
        for r in range(world):
            mine = plan_own(tensors, r, "s", 64, chunk)
            by_rank[r] = mine
            for w in mine:
                pos = next(i for i, t in enumerate(merged.tensors) if t.key == w.key)
                assert holds(layouts[pos], r), (w.key, r)
                written[w.key].append((w.offsets, w.sizes))
        for t in merged.tensors:
            assert check_chunks_tile(t.shape, written[t.key]) is None, t.key
            assert sum(numel(z) for _, z in written[t.key]) == math.prod(t.shape), t.key
        # a reader replays from the index: ``at`` recorded, ``group`` not (a tensor held whole: in the index)
        index = [(t, Layout(la.mesh, la.shards, la.order, la.at)) for t, la in tensors]
        for r, mine in by_rank.items():
            for w in mine:
                pos = next(i for i, t in enumerate(merged.tensors) if t.key == w.key)
                la = index[pos][1]
                if all(d is None for d in la.shards):
                    continue
                members = layout_holders(la, r)
                if len(members) > 1:
                    assert group_writers(index, members[0], chunk)[members][(pos, (w.offsets, w.sizes))] == r
    assert done > 40


def test_sixteen_thousand_ranks_in_sixteen_stages_plan_a_rank_in_what_it_holds():
    """PP 16 × FSDP 1,024, 40 tensors a stage: the merge and one rank's plan; its writes are its own stage's."""
    pp, dp = 16, 1024
    world = pp * dp
    class_of = np.repeat(np.arange(pp), dp).astype(np.int32)
    mesh = Layout((pp, dp), (None, 0))
    descs = [(tuple(_meta(f"layers.{s}.w{i}", (4096, 1024)) for i in range(40)) +
              tuple(_meta(f"layers.{s}.w{i}.step", ()) for i in range(40)),
              (mesh,) * 40 + (Layout((world,), (None,)),) * 40, (), (64, 1 << 20, True)) for s in range(pp)]
    merged = merge_stages(descs, class_of)
    assert isinstance(merged, Staged) and len(merged.tensors) == 80 * pp
    layouts = stage_layouts(merged, class_of)
    rank = 5 * dp + 17
    mine = plan_own(list(zip(merged.tensors, layouts)), rank, "s", 64, 1 << 20)
    assert {w.key.split(".")[1] for w in mine} == {"5"}
    assert sum(w.length for w in mine) == 40 * 4 * 1024 * 4096 // dp + sum(
        DTYPE_ITEMSIZE["float32"] for w in mine if w.key.endswith(".step"))
    steps = [w for w in mine if w.key.endswith(".step")]
    assert len(steps) <= 1      # the stage's 40 step counts spread over its 1,024 ranks


@pytest.mark.parametrize("members", [np.array([], dtype=np.int64), np.array([3])])
def test_a_sharding_layout_held_by_no_slice_is_not_scoped(members):
    assert scoped(Layout((2, 2), (None, 0)), members) is None
