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
