"""``planning.geometry.check_chunks_tile`` on many boxes (its numpy path, from ``_MANY`` boxes on) gives the same
verdict as its general path on the same boxes, for tilings and for every way of breaking one."""

from __future__ import annotations

import random

from liferaft.planning.geometry import _MANY, check_chunks_tile


def _grid(rng: random.Random, shape: tuple[int, ...]) -> list:
    cuts = [sorted({0, *rng.sample(range(1, n), min(n - 1, rng.randint(1, 80)))}) for n in shape]
    boxes = [((), ())]
    for d, c in enumerate(cuts):
        ends = [*c[1:], shape[d]]
        boxes = [(o + (a,), z + (b - a,)) for o, z in boxes for a, b in zip(c, ends)]
    return boxes


def _broken(rng: random.Random, boxes: list, shape: tuple[int, ...], how: str) -> list:
    out = list(boxes)
    i = rng.randrange(len(out))
    o, z = out[i]
    if how == "gap":
        out.pop(i)
    elif how == "replica":
        out.append(out[i])
    elif how == "empty":
        out.append((o, (0,) + z[1:]))
    elif how == "outside":
        out[i] = (o, (z[0] + shape[0],) + z[1:])
    elif how == "overlap":
        out[i] = (o, (z[0] + 1,) + z[1:]) if o[0] + z[0] < shape[0] else ((o[0] - 1,) + o[1:], z)
    elif how == "shifted":
        out[i] = ((o[0] + 1,) + o[1:], z)
    elif how == "same offsets":
        out.append((o, (z[0] - 1,) + z[1:]) if z[0] > 1 else (o, (z[0] + 1,) + z[1:]))
    rng.shuffle(out)
    return out


def test_many_boxes_get_the_verdict_of_the_general_check():
    rng = random.Random(5)
    seen = set()
    for trial in range(60):
        shape = (rng.randint(200, 2000), rng.randint(60, 300))
        boxes = _grid(rng, shape)
        if len(boxes) < _MANY:
            continue
        for how in ("none", "gap", "replica", "empty", "outside", "overlap", "shifted", "same offsets"):
            case = boxes if how == "none" else _broken(rng, boxes, shape, how)
            fast = check_chunks_tile(shape, case)                   # (a list: the numpy path)
            general = check_chunks_tile(shape, iter(case))          # (an iterator: the general path)
            assert (fast is None) == (general is None), (trial, how, fast, general)
            seen.add((how, fast is None))
    assert ("none", True) in seen and ("gap", False) in seen and ("replica", True) in seen
    assert ("overlap", False) in seen and ("outside", False) in seen


def test_boxes_the_numpy_path_cannot_take_as_they_are_get_the_general_verdict():
    """Boxes of another rank than the shape, floats, dimensions near 2**63 and boxes of more than 2**63 elements
    (found by a review: the numpy path accepted overlaps, truncated floats, wrapped int64)."""
    cells = [((i, j), (1, 1)) for i in range(64) for j in range(64)]
    big = 1 << 51
    runs = [((i * big,), (big,)) for i in range(4096)]
    runs[1] = ((big - 1,), (big,))                              # overlaps its neighbour by 1, then a gap of 1
    cases = [
        ((64, 64), [((o[0], o[1], z[0]), (z[1],)) for o, z in cells]),      # offsets and sizes of other ranks
        ((64, 64), [((o[0] + 0.9, o[1]), z) for o, z in cells]),           # floats
        ((4096 * big,), runs),                                              # near 2**63: float cuts
        ((1 << 62, 4096), [((0, j), (1 << 62, 1)) for j in range(4096)]),    # boxes beyond 2**63 elements
        ((64, 64), [((i, j), (True, 1)) for (i, j), _ in cells]),           # bools
    ]
    for shape, boxes in cases:
        assert (check_chunks_tile(shape, boxes) is None) == (check_chunks_tile(shape, iter(boxes)) is None), shape
    assert check_chunks_tile((64, 64), cases[0][1]) is not None and check_chunks_tile((4096 * big,), runs) is not None
