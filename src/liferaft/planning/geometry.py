"""Box arithmetic on row-major tensors. Pure functions of tuples; no torch.

A *box* is ``(offsets, sizes)``: the elements ``offsets[d] <= i[d] < offsets[d] + sizes[d]`` of a tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from liferaft.format.limits import MAX_CHUNKS_PER_TENSOR, SWEEP_BUDGET

Box = tuple[tuple[int, ...], tuple[int, ...]]


def numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None if they share no element."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def in_bounds(box: Box, shape: Sequence[int]) -> bool:
    return len(box[0]) == len(shape) == len(box[1]) and all(
        o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(box[0], box[1], shape))


def _depth(boxes: Sequence[Box], dim: int) -> int:
    """Most boxes whose extents along ``dim`` share one coordinate (an event sweep: O(n log n))."""
    events = sorted([(b[0][dim], 1) for b in boxes] + [(b[0][dim] + b[1][dim], -1) for b in boxes])
    depth = best = 0
    for _, step in events:                  # ends (-1) sort before starts at one coordinate: half-open extents
        depth += step
        best = max(best, depth)
    return best


def _grid_disjoint(shape: Sequence[int], boxes: Sequence[Box]) -> bool | None:
    """Whether ``boxes`` are pairwise disjoint, when each box is one cell of the grid its distinct offsets draw
    (the layout of every real sharding: row, column and block shards); None when they are not such a grid."""
    cuts = [sorted({b[0][d] for b in boxes} | {shape[d]}) for d in range(len(shape))]
    nxt = [dict(itertools.pairwise(c)) for c in cuts]
    for b in boxes:
        if any(nxt[d].get(b[0][d]) != b[0][d] + b[1][d] for d in range(len(shape))):
            return None
    return len({b[0] for b in boxes}) == len(boxes)


def check_chunks_tile(shape: Sequence[int], boxes: Iterable[Box]) -> str | None:
    """Return a description of the problem unless the distinct boxes tile ``shape`` exactly, else None.

    Identical boxes count once (replicas). In bounds, pairwise disjoint and their volumes summing to the shape's
    (exact integers) is an exact tiling. Checked in near-linear time for any input: bounds and the volume sum
    first; then disjointness by the grid the offsets draw (each box one cell: O(n log n)), else by a sweep along
    the dimension where the fewest boxes share a coordinate, whose pairwise comparisons are capped
    (``SWEEP_BUDGET`` per box): a layout that would need more is refused as too fragmented rather than hang.
    More than ``MAX_CHUNKS_PER_TENSOR`` boxes are refused up front. A tensor stored whole (one box at offset
    0 that is the shape, the common case) is answered at once.
    """
    if isinstance(boxes, Sequence) and len(boxes) == 1:
        offsets, sizes = boxes[0]
        if (len(offsets) == len(shape) and tuple(sizes) == tuple(shape) and not any(offsets)
                and min(shape, default=0) >= 0):
            return None
    if isinstance(boxes, Sequence) and len(boxes) >= _MANY and shape:
        found = _tiles_many(shape, boxes)
        if found is not _UNDECIDED:
            return found
    distinct = sorted({(tuple(o), tuple(s)) for o, s in boxes if numel(s) > 0})
    if len(distinct) > MAX_CHUNKS_PER_TENSOR:
        return f"{len(distinct)} chunks, more than the {MAX_CHUNKS_PER_TENSOR} a tensor may have"
    for box in distinct:
        if not in_bounds(box, shape):
            return f"chunk at offsets {list(box[0])} with sizes {list(box[1])} lies outside the global shape {list(shape)}"
    total = numel(shape)
    if not shape:
        return None if len(distinct) == 1 else "no chunk covers the scalar"
    covered = sum(numel(b[1]) for b in distinct)
    problem = None if not distinct or _grid_disjoint(shape, distinct) else _overlap(shape, distinct)
    if problem:
        return problem
    if covered != total:
        return f"chunks cover {covered} of {total} elements of the global shape {list(shape)}"
    return None


#: from this many boxes on, ``check_chunks_tile`` checks them as arrays (``_tiles_many``)
_MANY = 4096
_UNDECIDED = "undecided"


def _tiles_many(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """``check_chunks_tile`` of many boxes with numpy (the same verdict, in C loops: an index of a million
    explicit boxes is checked in a second, not a minute), or ``_UNDECIDED`` when the boxes are not plain
    non-negative int64 boxes of the shape's rank or are not cells of the grid their offsets draw (then the
    general check decides)."""
    nd = len(shape)
    if not all(type(n) is int and 0 <= n < 1 << 62 for n in shape) or numel(shape) >= 1 << 63:
        return _UNDECIDED                   # (int64 arithmetic below: exact for such shapes and their boxes)
    if not all(len(o) == nd == len(z) for o, z in boxes) or \
            not {type(x) for o, z in boxes for x in (*o, *z)} <= {int}:
        return _UNDECIDED                   # (floats, bools, strings, numpy scalars: the general check names them)
    try:
        both = np.array([(*o, *z) for o, z in boxes], dtype=np.int64).reshape(len(boxes), 2 * nd)
    except (OverflowError, TypeError, ValueError):
        return _UNDECIDED
    if (both < 0).any():
        return _UNDECIDED
    both = both[(both[:, nd:] > 0).all(axis=1)]             # (empty boxes hold nothing)
    both = np.unique(both, axis=0)                           # distinct, identical replicas counted once
    if len(both) > MAX_CHUNKS_PER_TENSOR:
        return f"{len(both)} chunks, more than the {MAX_CHUNKS_PER_TENSOR} a tensor may have"
    first, sizes = both[:, :nd], both[:, nd:]
    dims = np.array(shape, dtype=np.int64)
    outside = ((first > dims) | (sizes > dims - np.minimum(first, dims))).any(axis=1)    # (no overflow)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        return (f"chunk at offsets {first[i].tolist()} with sizes {sizes[i].tolist()} lies outside the global shape "
                f"{list(shape)}")
    for d in range(nd):                                     # each box one cell of the grid of offsets?
        cuts = np.unique(np.append(first[:, d], shape[d]))
        at = np.searchsorted(cuts, first[:, d])
        if not (at + 1 < len(cuts)).all() or not (cuts[np.minimum(at + 1, len(cuts) - 1)] == first[:, d] +
                                                   sizes[:, d]).all():
            return _UNDECIDED
    if len(np.unique(first, axis=0)) != len(first):
        i = _first_repeat(first)
        return f"chunks at offsets {first[i].tolist()} overlap without being identical"
    covered, total = sum(np.prod(sizes, axis=1).tolist()), numel(shape)
    if covered != total:
        return f"chunks cover {covered} of {total} elements of the global shape {list(shape)}"
    return None


def _first_repeat(rows: np.ndarray) -> int:
    """The index of a row of ``rows`` equal to another one."""
    _, first_at, counts = np.unique(rows, axis=0, return_index=True, return_counts=True)
    return int(first_at[np.flatnonzero(counts > 1)[0]])


def _overlap(shape: Sequence[int], distinct: Sequence[Box]) -> str | None:
    """The first two of ``distinct`` that overlap, described; None when none do (or when the sweep's budget ran
    out: then a refusal naming the fragmentation)."""
    dim = min(range(len(shape)), key=lambda d: _depth(distinct, d))
    order = sorted(distinct, key=lambda b: b[0][dim])
    budget = SWEEP_BUDGET * len(order) + SWEEP_BUDGET
    active: list[Box] = []
    for box in order:
        start = box[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        budget -= len(active) + 1
        if budget < 0:
            return (f"its {len(distinct)} chunks are too fragmented to check (more than {SWEEP_BUDGET} comparisons "
                    "per chunk); no writer lays chunks out this way")
        for other in active:
            if intersect(other, box) is not None:
                return (f"chunks at offsets {list(other[0])} (sizes {list(other[1])}) and {list(box[0])} "
                        f"(sizes {list(box[1])}) overlap without being identical")
        active.append(box)
    return None


def byte_span(box: Box, chunk_sizes: Sequence[int], itemsize: int) -> tuple[int, int]:
    """[start, end) byte range, within a row-major chunk of ``chunk_sizes``, spanned by the (chunk-local) box."""
    st = strides(chunk_sizes)
    first = sum(o * s for o, s in zip(box[0], st))
    last = sum((o + n - 1) * s for o, n, s in zip(box[0], box[1], st))
    return first * itemsize, (last + 1) * itemsize


def _max_gap(box: Box, chunk_sizes: Sequence[int], itemsize: int) -> int:
    """Largest run of unneeded bytes between two needed bytes inside the box's span."""
    st = strides(chunk_sizes)
    gap = 0
    for d in range(len(chunk_sizes)):
        if box[1][d] > 1:
            # two consecutive indices along d: the gap is the stride minus what one slice spans
            inner = (box[0][:d] + (box[0][d],) + box[0][d + 1:], box[1][:d] + (1,) + box[1][d + 1:])
            lo, hi = byte_span(inner, chunk_sizes, itemsize)
            gap = max(gap, st[d] * itemsize - (hi - lo))
    return gap


def split_for_reading(box: Box, chunk_sizes: Sequence[int], itemsize: int, block: int, max_read: int) -> list[Box]:
    """Split a chunk-local box into sub-boxes that are each read as one contiguous byte range.

    Each piece spans at most ``max_read`` bytes (unless a single element row is larger, in which case the
    contiguous innermost run is split) and contains no hole of ``block`` bytes or more, so reading it (rounded
    out to whole hash blocks) fetches little more than the needed bytes.
    """
    if not any(box[0]) and tuple(box[1]) == tuple(chunk_sizes) and numel(chunk_sizes) * itemsize <= max_read:
        return [box]                    # the whole chunk: one contiguous range without holes (the common read)
    out: list[Box] = []
    stack = [box]
    while stack:
        b = stack.pop()
        lo, hi = byte_span(b, chunk_sizes, itemsize)
        if (hi - lo <= max_read and _max_gap(b, chunk_sizes, itemsize) < block) or numel(b[1]) <= 1:
            out.append(b)
            continue
        d = next(i for i, s in enumerate(b[1]) if s > 1)
        half = b[1][d] // 2
        o, s = list(b[0]), list(b[1])
        first = (tuple(o), tuple(s[:d] + [half] + s[d + 1:]))
        second = (tuple(o[:d] + [o[d] + half] + o[d + 1:]), tuple(s[:d] + [s[d] - half] + s[d + 1:]))
        stack.append(second)
        stack.append(first)
    return out


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut ``box`` into sub-boxes of at most ``limit`` bytes that tile it, each a contiguous run of its row-major
    elements (whole rows of the leading dimension where a row fits, else parts of one row, recursively), in
    row-major order. A box within the limit comes back as is."""
    offsets, sizes = box
    if numel(sizes) * itemsize <= limit or not sizes:
        return [box]
    row = numel(sizes[1:]) * itemsize
    if row <= limit or len(sizes) == 1:
        step = max(1, limit // max(row, 1))
        return [((offsets[0] + r,) + offsets[1:], (min(step, sizes[0] - r),) + sizes[1:])
                for r in range(0, sizes[0], step)]
    out: list[Box] = []
    for r in range(sizes[0]):
        for sub_off, sub_sizes in split_box((offsets[1:], sizes[1:]), itemsize, limit):
            out.append(((offsets[0] + r,) + sub_off, (1,) + sub_sizes))
    return out
