"""Save planning from compact layouts: each rank plans its own writes, with nothing gathered.

A tensor laid out the way DTensor lays it out — over the ranks ``0..world-1`` arranged row-major as a ``mesh``,
each mesh dimension either sharding one tensor dimension (``Shard(d)``: torch.chunk's even split, a later mesh
dimension splitting what an earlier one left) or replicating it — is described by one :class:`Layout`, whatever
the rank count. A plain tensor every rank holds whole is ``Layout((world,), (None,))``. From a layout every rank
can compute any rank's box and the holders of its own, so when every rank describes the same tensors with the
same layouts (checked by comparing one digest: ``core.phases``), each rank plans its own writes in time and
memory that grow with what it holds, not with the job (issue #20). A ``_StridedShard`` (FSDP2 over tensor
parallelism) is a layout too, whose boxes each rank takes from its DTensor — unless the TP split is even, where
it is a nested split with the TP dimension first (:func:`as_ordered`: a regular layout with an ``order``); a
DTensor on a sub-mesh (FSDP2 on ``mesh["dp"]``) is described over the root mesh, replicated along the dimensions
the sub-mesh lacks. A reader finds the boxes overlapping a box by grid arithmetic (:func:`overlapping`) and the
member of a group of replicas that wrote each chunk by replaying the plan (:func:`group_writers`).

The plan it gives is a valid save plan (every element written exactly once, by a rank that holds it; chunks of
at most ``chunk_bytes``; the writer's file laid out as :func:`planning.save_plan.plan_save` lays it out), not
the same one: the chunks of the boxes held by one group of replicas are balanced within that group (largest
first, to the member with the fewest bytes of that group so far; ties rotate with the group), so the busiest
member of a group writes at most one chunk more than its least busy member.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from liferaft.format.layout import data_file_name
from liferaft.format.manifest import DTYPE_ITEMSIZE
from liferaft.planning.geometry import Box, numel, split_box
from liferaft.planning.save_plan import TensorMeta, WriteItem, place


@dataclass(frozen=True)
class Layout:
    """A tensor over the ranks ``0..prod(mesh)-1`` arranged row-major as ``mesh``: ``shards[i]`` is the tensor
    dimension mesh dimension ``i`` shards (``None``: it replicates; ``(dim, split_factor)``: DTensor's
    ``_StridedShard``, FSDP2 over tensor parallelism, whose boxes each rank takes from its DTensor rather than
    from :func:`layout_box`)."""

    mesh: tuple[int, ...]
    shards: tuple[int | tuple[int, int] | None, ...]
    #: the order in which the mesh dimensions split the tensor (None: ``0, 1, ...``, DTensor's for ``Shard``);
    #: another order describes FSDP2 over tensor parallelism where its ``_StridedShard`` is a plain nested split
    #: (:func:`as_ordered`)
    order: tuple[int, ...] | None = None
    #: (pipeline stages) the coordinate fixed along some replicating mesh dimensions (None elsewhere): only the
    #: ranks at ``at`` hold the tensor (a DTensor on the sub-mesh of one stage, its key held by that stage
    #: alone: ``planning.stages``); None: every coordinate holds it
    at: tuple[int | None, ...] | None = None
    #: (pipeline stages, a tensor held whole) the ranks holding it, in order, when not every rank does; planning
    #: only (its chunks are listed in the index, which records no group)
    group: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        return numel(self.mesh)

    @property
    def steps(self) -> tuple[int, ...]:
        """The mesh dimensions in the order they split the tensor."""
        return self.order if self.order is not None else tuple(range(len(self.mesh)))

    @property
    def regular(self) -> bool:
        """Whether :func:`layout_box` describes it (no ``_StridedShard``)."""
        return not any(isinstance(d, tuple) for d in self.shards)


def coordinate(mesh: Sequence[int], rank: int) -> tuple[int, ...]:
    """``rank``'s place in the row-major ``mesh``."""
    out = []
    for n in reversed(mesh):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


def layout_box(layout: Layout, shape: Sequence[int], rank: int) -> Box:
    """The box of the global tensor of ``shape`` that ``rank`` holds (sizes 0 along a dimension: it holds none).
    Each ``Shard(d)`` splits the extent left along ``d`` into ``mesh[i]`` parts of ``ceil(n / mesh[i])``, the last
    ones shorter or empty, as DTensor does."""
    if not layout.regular:
        raise ValueError(f"layout_box: {layout} has a _StridedShard; take the rank's boxes from its DTensor")
    offs, sizes = [0] * len(shape), list(shape)
    coord = coordinate(layout.mesh, rank)
    if not holds(layout, rank, coord):
        return tuple(0 for _ in shape), tuple(0 for _ in shape)
    for i in layout.steps:
        n, d, c = layout.mesh[i], layout.shards[i], coord[i]
        if not isinstance(d, int):
            continue
        full = -(-sizes[d] // n)
        start = min(full * c, sizes[d])
        size = min(sizes[d], start + full) - start
        offs[d], sizes[d] = offs[d] + start, size
    if 0 in sizes:
        return tuple(0 for _ in shape), tuple(sizes)
    return tuple(offs), tuple(sizes)


def holds(layout: Layout, rank: int, coord: Sequence[int] | None = None) -> bool:
    """Whether ``rank`` (at ``coord`` of the mesh) is one of the ranks holding a tensor of ``layout`` (every rank,
    unless ``at`` or ``group`` restrict them)."""
    if layout.group is not None:
        i = bisect.bisect_left(layout.group, rank)
        return i < len(layout.group) and layout.group[i] == rank
    if layout.at is not None:
        coord = coordinate(layout.mesh, rank) if coord is None else coord
        return all(a is None or a == c for a, c in zip(layout.at, coord))
    return True


def layout_holders(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks holding the same box as ``rank`` (one that holds it): its coordinate varied along the replicating
    mesh dimensions that ``at`` does not fix, in rank order (a ``group``: its ranks)."""
    if layout.group is not None:
        return layout.group
    coord = coordinate(layout.mesh, rank)
    at = layout.at or (None,) * len(layout.mesh)
    ranks = [0]
    for n, d, c, a in zip(layout.mesh, layout.shards, coord, at):
        ranks = [r * n + i for r in ranks for i in ((c,) if d is not None or a is not None else range(n))]
    return tuple(ranks)


def plan_own(tensors: Sequence[tuple[TensorMeta, Layout]], rank: int, save_id: str, alignment: int,
             chunk_bytes: int) -> tuple[WriteItem, ...]:
    """The chunks ``rank`` writes for a save of ``tensors`` (every tensor of the state, in manifest order, each
    with its layout; the same sequence on every rank), laid out in its data file. Each of the rank's non-empty
    boxes (:func:`layout_box`; for a layout that is not ``regular``, the ``boxes`` of its ``TensorMeta``, which
    every member of a group of replicas holds alike) is cut into chunks of at most ``chunk_bytes``
    (``geometry.split_box``); the chunks of all boxes held by one group of ranks are assigned within that group,
    largest first, to the member with the fewest bytes so far (ties: the member after the group's rotation),
    computed identically by every member."""
    mine: list[tuple[int, int, str, Box, Box]] = []
    for members, _, jobs in _own_jobs(tensors, rank, chunk_bytes):
        if len(members) == 1:
            mine.extend(jobs)
        else:
            mine.extend(j for j, r in _assign(members, jobs) if r == rank)
    mine.sort(key=lambda j: (j[1], j[3]))
    fname = data_file_name(save_id, rank)
    pos, out = 0, []
    for nbytes, _, key, box, held in mine:
        pos = place(pos, nbytes, alignment)
        out.append(WriteItem(key=key, offsets=box[0], sizes=box[1], file=fname, byte_offset=pos, length=nbytes,
                             parent=None if held == box else held))
        pos += nbytes
    return tuple(out)


_Job = tuple[int, int, str, Box, Box]       # (bytes, position of the tensor, key, chunk, the box it is cut from)


def _own_jobs(tensors: Sequence[tuple[TensorMeta, Layout]], rank: int, chunk_bytes: int
              ) -> list[tuple[tuple[int, ...], bool, list[_Job]]]:
    """The chunks of every box ``rank`` holds, by the group of ranks holding that box (``plan_own``), each group
    with whether it holds tensors of ``group`` layouts: those (held whole by some ranks, their chunks listed in
    the index) are balanced apart from the others, whose groups a reader replays from the index (which records
    no ``group``)."""
    groups: dict[tuple[int, ...], list[_Job]] = {}
    apart: dict[tuple[int, ...], list[_Job]] = {}
    holders: dict[Layout, list[_Job]] = {}      # (a model has a few layouts)
    for pos, (t, layout) in enumerate(tensors):
        if (layout.at is not None or layout.group is not None) and not holds(layout, rank):
            continue            # (not its stage's: a 0-dim tensor's empty box would still hold one element)
        boxes = (layout_box(layout, t.shape, rank),) if layout.regular else t.boxes
        isz = DTYPE_ITEMSIZE[t.dtype]
        for held in boxes:
            if numel(held[1]) == 0:
                continue
            jobs = holders.get(layout)
            if jobs is None:
                jobs = holders[layout] = (apart if layout.group is not None else groups).setdefault(
                    layout_holders(layout, rank), [])
            for box in split_box(held, isz, chunk_bytes):
                jobs.append((numel(box[1]) * isz, pos, t.key, box, held))
    return [(m, False, j) for m, j in groups.items()] + [(m, True, j) for m, j in apart.items()]


def _assign(members: tuple[int, ...], jobs: list[_Job]) -> list[tuple[_Job, int]]:
    """Each of the chunks ``jobs`` of a group of replicas ``members`` with the member that writes it: largest
    first, to the member with the fewest bytes so far, ties to the member after the group's rotation."""
    jobs.sort(key=lambda j: (-j[0], j[1], j[3]))
    turn = sum(members) % len(members)
    heap = [(0, (i - turn) % len(members), r) for i, r in enumerate(members)]
    heapq.heapify(heap)
    out = []
    for job in jobs:
        load, order, r = heapq.heappop(heap)
        out.append((job, r))
        heapq.heappush(heap, (load + job[0], order, r))
    return out


def group_writers(tensors: Sequence[tuple[TensorMeta, Layout]], member: int, chunk_bytes: int, whole: bool = False
                  ) -> dict[tuple[int, ...], dict[tuple[int, Box], int]]:
    """For each group of replicas ``member`` belongs to, which member writes each chunk (by tensor position and
    box) in ``plan_own``: what a reader replays to find the rank whose chunk table holds a chunk. ``whole``: the
    groups of the tensors of ``group`` layouts instead (held whole by some ranks: what their writers list in the
    index)."""
    return {members: {(j[1], j[3]): r for j, r in _assign(members, jobs)}
            for members, apart, jobs in _own_jobs(tensors, member, chunk_bytes)
            if len(members) > 1 and apart == whole}


def overlapping(layout: Layout, shape: Sequence[int], box: Box) -> list[tuple[Box, int]]:
    """The non-empty boxes of a regular ``layout`` of a tensor of ``shape`` that share an element with ``box``,
    each with one rank holding it (the one at coordinate 0, or ``at``, along the replicating mesh dimensions): grid
    arithmetic over the mesh, in time that grows with the boxes found, not with the ranks."""
    if numel(box[1]) == 0:
        return []
    lo, hi = box[0], tuple(o + s for o, s in zip(*box))
    start = tuple(0 if a is None else a for a in layout.at) if layout.at is not None else (0,) * len(layout.mesh)
    states: list[tuple[tuple[int, ...], list[int], list[int]]] = [(start, [0] * len(shape), list(shape))]
    for i in layout.steps:
        n, d = layout.mesh[i], layout.shards[i]
        nxt = []
        for coord, offs, sizes in states:
            if d is None:
                nxt.append((coord, offs, sizes))
                continue
            assert isinstance(d, int)
            full = -(-sizes[d] // n)
            if full == 0:
                continue
            first = max(0, (lo[d] - offs[d]) // full)
            last = min(n - 1, (hi[d] - 1 - offs[d]) // full)
            for c in range(first, last + 1):
                start = min(full * c, sizes[d])
                size = min(sizes[d], start + full) - start
                if size > 0:
                    o, z = list(offs), list(sizes)
                    o[d], z[d] = offs[d] + start, size
                    nxt.append((coord[:i] + (c,) + coord[i + 1:], o, z))
        states = nxt
    return [((tuple(o), tuple(z)), _rank_of(layout.mesh, coord)) for coord, o, z in states
            if all(a < h and a + b > q for a, b, q, h in zip(o, z, lo, hi))]


def _rank_of(mesh: Sequence[int], coord: Sequence[int]) -> int:
    """The rank at ``coord`` of the row-major ``mesh`` (:func:`coordinate`'s inverse)."""
    rank = 0
    for n, c in zip(mesh, coord):
        rank = rank * n + c
    return rank


def as_ordered(layout: Layout, shape: Sequence[int]) -> Layout | None:
    """A regular layout with the boxes of ``layout`` when its one ``_StridedShard(d, sf)`` (FSDP2 over tensor
    parallelism: on mesh dimension ``a``) is followed by exactly one ``Shard(d)`` on a mesh dimension ``b`` of
    ``sf`` ranks, no other mesh dimension splits ``d``, and ``sf`` divides ``shape[d]``: then the rows a rank holds
    are those of splitting by ``b`` first, then by ``a`` (checked against DTensor's own boxes: tests); else None."""
    strided = [i for i, d in enumerate(layout.shards) if isinstance(d, tuple)]
    if len(strided) != 1:
        return None
    a = strided[0]
    d, sf = layout.shards[a]            # type: ignore[misc]
    later = [i for i, x in enumerate(layout.shards) if x == d]
    if len(later) != 1 or later[0] < a or layout.mesh[later[0]] != sf or not 0 <= d < len(shape) or shape[d] % sf:
        return None
    b = later[0]
    steps = [i for i in range(len(layout.mesh)) if i != b]
    steps.insert(steps.index(a), b)
    shards = tuple(d if i == a else x for i, x in enumerate(layout.shards))
    return Layout(layout.mesh, shards, tuple(steps))


def probe_ranks(world: int) -> tuple[int, ...]:
    """The ranks whose boxes :func:`infer_layout` reads: 0 and every divisor of ``world`` below it (the strides of
    every row-major mesh of ``world`` ranks), in order; at most a few hundred ranks whatever the world."""
    small = [d for d in range(1, int(world ** 0.5) + 1) if world % d == 0]
    return (0,) + tuple(sorted({*small, *(world // d for d in small)} - {world}))


def infer_layout(shape: Sequence[int], boxes: dict[int, Box], world: int) -> Layout | None:
    """A regular layout over ``world`` ranks in which every rank of ``boxes`` (the boxes of at least
    :func:`probe_ranks`, by rank) holds its box, or None when none is found: what hand-made shards
    (``Sharded``) and DTensors on a mesh of the ranks in another order are described by when they follow one.
    The mesh is read from the probes, its innermost dimension first: at stride ``s`` the box of rank ``s``
    either equals rank 0's (a replicating dimension, as long as the ranks ``s·k`` hold the same) or moves along
    one tensor dimension by one block (a sharding one, as long as the ranks ``s·k`` hold block ``k``). Each
    tensor dimension is split as DTensor splits it (``ceil(n / parts)``, trailing parts shorter or empty); the
    layout is returned only if it gives every probe its box. A caller must still check every other rank's box
    (each rank checks its own) before using it."""
    def same(a: Box, b: Box) -> bool:
        return a == b or numel(a[1]) == 0 == numel(b[1])

    nd = len(shape)
    if 0 not in boxes or any(not (isinstance(b, tuple) and len(b) == 2 and all(
            isinstance(v, tuple) and len(v) == nd and all(type(x) is int for x in v) for v in b))
            for b in boxes.values()):
        return None
    b0 = boxes[0]
    if numel(b0[1]) == 0:
        return None
    dims: list[tuple[int, int | None]] = []         # (size, tensor dimension it shards), innermost first
    s = 1
    while s < world:
        rest = world // s
        ks = [k for k in range(2, rest) if rest % k == 0]
        at = boxes.get(s)
        if at is None or any(s * k not in boxes for k in ks):
            return None
        if same(at, b0):
            size = next((k for k in ks if not same(boxes[s * k], b0)), rest)
            dims.append((size, None))
        else:
            moved = [d for d in range(len(shape)) if (at[0][d], at[1][d]) != (b0[0][d], b0[1][d])]
            if numel(at[1]) == 0 or len(moved) != 1 or at[0][moved[0]] <= b0[0][moved[0]]:
                return None
            d = moved[0]
            full, lo = at[0][d] - b0[0][d], b0[0][d]

            def block(k: int, d: int = d, full: int = full, lo: int = lo) -> Box:
                start = lo + full * k
                size = min(full, shape[d] - start)
                if size <= 0:
                    return tuple(0 for _ in shape), tuple(0 for _ in shape)
                return (b0[0][:d] + (start,) + b0[0][d + 1:], b0[1][:d] + (size,) + b0[1][d + 1:])

            size = next((k for k in ks if not same(boxes[s * k], block(k))), rest)
            dims.append((size, d))
        s *= dims[-1][0]
    layout = Layout(tuple(n for n, _ in reversed(dims)) or (1,), tuple(d for _, d in reversed(dims)) or (None,))
    if layout.world != world or any(not same(layout_box(layout, shape, r), b) for r, b in boxes.items()):
        return None
    return layout
