"""``planning.layouts.infer_layout``: the layout hand-made shards follow, read from the boxes of the probe ranks
(0 and every divisor of the world), and ``core.described.infer_unknown`` over many tensors."""

from __future__ import annotations

import random

import pytest

import liferaft
from liferaft.core.described import infer_unknown
from liferaft.errors import InvalidStateError
from liferaft.planning.geometry import numel
from liferaft.planning.layouts import Layout, infer_layout, layout_box, probe_ranks


def _same(a, b) -> bool:
    return a == b or numel(a[1]) == 0 == numel(b[1])


def _random_layout(rng: random.Random) -> tuple[Layout, tuple[int, ...]]:
    nd = rng.randint(1, 3)
    mesh = tuple(rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(rng.randint(1, 3)))
    shards = tuple(rng.choice([None, *range(nd)]) for _ in mesh)
    shape = tuple(rng.choice([1, 2, 3, 7, 8, 12, 16, 30]) for _ in range(nd))
    return Layout(mesh, shards), shape


def test_probe_ranks_are_zero_and_the_divisors_of_the_world():
    assert probe_ranks(1) == (0,)
    assert probe_ranks(12) == (0, 1, 2, 3, 4, 6)
    assert probe_ranks(7) == (0, 1)
    assert len(probe_ranks(16384)) == 15 and len(probe_ranks(100_000)) == 36


def test_a_layout_with_each_tensor_dimension_split_once_and_no_empty_box_is_found():
    rng = random.Random(7)
    found = 0
    for _ in range(3000):
        true, shape = _random_layout(rng)
        split = [d for d in true.shards if d is not None]
        if len(split) != len(set(split)) or \
                any(numel(layout_box(true, shape, r)[1]) == 0 for r in range(true.world)):
            continue
        got = infer_layout(shape, {r: layout_box(true, shape, r) for r in probe_ranks(true.world)}, true.world)
        assert got is not None, (true, shape)
        for r in range(true.world):             # the same box on every rank, probed or not
            assert _same(layout_box(got, shape, r), layout_box(true, shape, r)), (true, got, shape, r)
        found += 1
    assert found > 1000


def test_whatever_is_inferred_gives_every_probe_its_box():
    """Nested and uneven splits, empty boxes: a layout, when one is returned, holds every probe's box (the other
    ranks check their own before it is used)."""
    rng = random.Random(11)
    for _ in range(3000):
        true, shape = _random_layout(rng)
        probes = {r: layout_box(true, shape, r) for r in probe_ranks(true.world)}
        got = infer_layout(shape, probes, true.world)
        if got is not None:
            assert got.world == true.world and got.regular
            for r, box in probes.items():
                assert _same(layout_box(got, shape, r), box)


def test_boxes_no_layout_describes_give_none():
    # rows split 4, 3, 3 (numpy's array_split, not torch.chunk's 4, 4, 2)
    assert infer_layout((10, 2), {0: ((0, 0), (4, 2)), 1: ((4, 0), (3, 2)), 2: ((7, 0), (3, 2))}, 3) is None
    # rank 1 holds the block before rank 0's
    assert infer_layout((8,), {0: ((4,), (4,)), 1: ((0,), (4,))}, 2) is None
    # rank 1 moved along two dimensions at once
    assert infer_layout((4, 4), {0: ((0, 0), (2, 2)), 1: ((2, 2), (2, 2))}, 2) is None
    # a probe missing, a malformed box, rank 0 holding nothing
    assert infer_layout((8,), {0: ((0,), (2,)), 1: ((2,), (2,))}, 4) is None
    assert infer_layout((8,), {0: ((0,), (4,)), 1: ((4,), (4.0,))}, 2) is None
    assert infer_layout((8,), {0: ((0,), (0,)), 1: ((0,), (8,))}, 2) is None


def test_hand_made_pairs_at_16k_ranks_are_inferred_once_for_every_tensor():
    world, rows, cols = 16384, 16384, 4096
    half = world // 2

    def box(r: int):
        lo = (r % half) * rows // half
        return (lo, 0), (rows // half, cols)

    probed = {r: tuple(box(r) for _ in range(1000)) for r in probe_ranks(world)}
    got = infer_unknown([(rows, cols)] * 1000, probed, world)
    assert len({id(la) for la in got}) == 1 and got[0] == Layout((2, half), (None, 0))     # inferred once
    assert all(layout_box(got[0], (rows, cols), r) == box(r) for r in range(0, world, 97))


def test_a_probe_describing_other_tensors_is_refused():
    with pytest.raises(InvalidStateError, match="rank 1 described 1 tensors"):
        infer_unknown([(4,), (4,)], {0: (((0,), (2,)), ((0,), (2,))), 1: (((2,), (2,)),)}, 2)


def test_an_index_with_more_boxes_than_a_tensor_may_have_is_refused_before_they_are_decoded():
    from liferaft.format.limits import MAX_CHUNKS_PER_TENSOR
    from liferaft.format.manifest import _boxes

    one = [0, [0], [1]]
    with pytest.raises(liferaft.CorruptCheckpointError, match="more than the"):
        _boxes([one] * (MAX_CHUNKS_PER_TENSOR + 1), "index tensor 'w'", (MAX_CHUNKS_PER_TENSOR + 1,))
    assert _boxes([[1, [2], [3]], one, [0, [1], [1]]], "w", (5,)) == ((0, (0,), (1,)), (0, (1,), (1,)),
                                                                        (1, (2,), (3,)))
    for bad in ([True, [0], [5]], [0, [0], [0]], [0, [1], [5]], [0, [0.0], [5]], [-1, [0], [5]], [0, [0, 0], [5]]):
        with pytest.raises(liferaft.CorruptCheckpointError):
            _boxes([bad], "w", (5,))
