"""The commit of a save whose chunk records live in per-rank chunk tables (format version 4, docs/FORMAT.md §4.6).

Each writing rank, once its data file is durable, writes the table of its chunks of sharded tensors beside it
(``write_table``) and sends rank 0 only the table's name, size, digest and chunk count, with the records of its
chunks of the tensors every rank holds whole (DDP's parameters, a model's replicated buffers: any rank loading
them needs them all, so they are listed in the index); rank 0 builds the index (``build_index``): the tensors with
their layouts, the files, the tables, the values and containers. What rank 0 receives to commit grows with the
ranks and the replicated tensors, not with the chunks of sharded ones.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from liferaft.codecs.checksum import digest
from liferaft.core.commit import frames_problem, read_table
from liferaft.errors import CorruptCheckpointError, InvalidStateError
from liferaft.format.layout import data_file_name, table_file_name
from liferaft.format.manifest import (
    DTYPE_ITEMSIZE,
    LEGACY_CHECKSUM,
    ChunkRecord,
    ContainerEntry,
    Manifest,
    TableRef,
    TensorEntry,
)
from liferaft.format.tables import encode_table
from liferaft.planning.geometry import Box, check_chunks_tile, intersect, numel, split_box
from liferaft.planning.layouts import Layout, group_writers, layout_box, layout_holders, overlapping
from liferaft.planning.save_plan import SavePlan, TensorMeta, WriteItem, chunk_record
from liferaft.storage import Storage

assert LEGACY_CHECKSUM == "xxh3_64"         # the digest ``TableRef.hash`` records (``codecs.checksum.digest``)


def replicated(layout: Layout | tuple[Any, ...] | None) -> bool:
    """Whether a tensor of ``layout`` is held whole by every rank (its chunks are listed in the index: any rank
    loading it needs them all, written by members spread over the whole world)."""
    shards = layout.shards if isinstance(layout, Layout) else layout[1] if layout is not None else (0,)
    return all(d is None for d in shards)


def write_table(storage: Storage, save_id: str, rank: int, plan: SavePlan, layouts: Sequence[Layout] | None,
                writes: Sequence[WriteItem], stored: Sequence[Any]
                ) -> tuple[TableRef | None, int, list[tuple[int, ChunkRecord]]]:
    """Write and make durable rank ``rank``'s chunk table (``stored[i]`` is how ``writes[i]`` was stored): its
    reference and size (None, 0: it holds no chunk of a sharded tensor), and the records of its chunks of the
    tensors every rank holds whole, which go to the index instead (``layouts`` None: a plan gathered from boxes
    that follow no layout, whose index lists every chunk's box: all its chunks go to the table)."""
    index = {t.key: i for i, t in enumerate(plan.tensors)}
    if len(stored) != len(writes):
        raise InvalidStateError(f"rank {rank} stored {len(stored)} chunks for {len(writes)} writes")
    records = [(index[w.key], chunk_record(w, sc)) for w, sc in zip(writes, stored)]
    inline = [(i, rec) for i, rec in records if layouts is not None and replicated(layouts[i])]
    mine = [(i, rec) for i, rec in records if layouts is None or not replicated(layouts[i])]
    if not mine:
        return None, 0, inline
    for i, rec in mine:         # (what every reader refuses is never committed: the save fails instead)
        if rec.delta is not None:
            raise InvalidStateError(f"rank {rank}: key {plan.tensors[i].key!r}: the chunk at {list(rec.offsets)} is "
                                    "an XOR delta, which a chunk table cannot list; nothing was committed")
    data = encode_table(save_id, rank, mine)
    name = table_file_name(save_id, rank)
    storage.put_atomic(name, data)
    storage.sync()
    return TableRef(file=name, rank=rank, hash=digest(data), chunks=len(mine)), len(data), inline


def build_index(plan: SavePlan, layouts: Sequence[Layout] | None,
                rows: Sequence[tuple[Any, ...]],
                *, save_id: str, values: tuple, containers: tuple[ContainerEntry, ...], created_unix: float,
                liferaft_version: str, torch_version: str, extra: dict, alignment: int, chunk_bytes: int
                ) -> Manifest:
    """The version 4 index of a save planned from ``layouts`` (``planning.layouts.plan_own``), from each rank's
    row: (its table or None, the table's size, its data file's size, the raw bytes it wrote, its records of the
    tensors every rank holds whole[, its writes' boxes as (key, offsets, sizes) or None[, the sizes of the other
    files its chunks lie in: an incremental save's references and its file of copied chunks]]). Refused (InvalidStateError)
    unless the ranks wrote exactly the tensors' bytes, once: the tables' chunks are the ranks' own plans, which
    tile every tensor by construction; this cheap sum catches plans that disagree. ``layouts`` None: explicit
    boxes, each rank's from its row (a plan made on each rank) or from ``plan.writes`` (a gathered plan), their
    tiling of every tensor checked here."""
    wrote = sum(r[3] for r in rows)
    total = sum(math.prod(t.shape) * DTYPE_ITEMSIZE[t.dtype] for t in plan.tensors)
    if wrote != total:
        raise InvalidStateError(f"the ranks wrote {wrote} bytes of tensors holding {total}: their own plans "
                                "disagree; nothing was committed")
    files: dict[str, int] = {}
    refs = []
    inline: list[list[ChunkRecord]] = [[] for _ in plan.tensors]
    written: list[Sequence[Any]] = []
    for rank, (ref, table_size, file_size, _, listed, *more) in enumerate(rows):
        boxes = more[0] if more else None
        written.append(boxes if boxes is not None else
                       [(w.key, w.offsets, w.sizes) for w in plan.writes[rank]] if rank < len(plan.writes) else [])
        for f, size in (more[1] if len(more) > 1 else {}).items():      # (an incremental save's other files)
            if files.setdefault(f, size) != size:
                raise InvalidStateError(f"ranks disagree on the size of {f!r} ({files[f]} and {size} bytes); "
                                        "nothing was committed")
        if file_size:
            files[data_file_name(save_id, rank)] = file_size
        if ref is not None:
            files[ref.file] = table_size
            refs.append(ref)
        for i, rec in listed:
            inline[i].append(rec)
    if layouts is None:             # (explicit boxes: each rank's writes, from a gathered plan or from its row)
        pos = {t.key: i for i, t in enumerate(plan.tensors)}
        boxes: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = [[] for _ in plan.tensors]
        for rank, writes in enumerate(written):
            for key, offsets, sizes in writes:
                boxes[pos[key]].append((rank, offsets, sizes))
        for t, b in zip(plan.tensors, boxes):      # (a plan made on each rank: rank 0 checks, before committing)
            problem = check_chunks_tile(t.shape, [(o, z) for _, o, z in b])
            if problem:
                raise InvalidStateError(f"key {t.key!r}: {problem}; the ranks' plans do not tile the tensor; "
                                        "nothing was committed")
        tensors = tuple(TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape, chunks=(),
                                    per_rank=t.per_rank, boxes=tuple(sorted(boxes[i], key=lambda b: b[1])))
                        for i, t in enumerate(plan.tensors))
    else:
        tensors = tuple(TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape,
                                    chunks=tuple(sorted(inline[i], key=lambda c: c.offsets)), per_rank=t.per_rank,
                                    layout=(la.mesh, la.shards, la.order, la.at))
                        for i, (t, la) in enumerate(zip(plan.tensors, layouts)))
    return Manifest(save_id=save_id, world_size=plan.world_size, created_unix=created_unix,
                    liferaft_version=liferaft_version, torch_version=torch_version, files=files, tensors=tensors,
                    values=values, containers=containers, extra=dict(extra), version=4, tables=tuple(refs),
                    planned={"alignment": alignment, "chunk_bytes": chunk_bytes})


class TableSource:
    """The chunk tables of a version 4 index, read as a load needs them (docs/FORMAT.md §4.6).

    ``resolve`` takes the boxes a rank reads and reads only the tables of the ranks that wrote chunks of them:
    the boxes of each tensor's layout that overlap a wanted box (``planning.layouts.overlapping``: grid
    arithmetic), and within a group of replicas the member the save's plan gave each chunk to
    (``group_writers``, replayed from the index). Every chunk of a table read must be one its rank was planned
    to write (a piece of its box, and its share within its group), listed once: so the chunks read are
    disjoint, and every wanted box must then be covered by them. A table that fails either check is refused
    (CorruptCheckpointError naming it) before anything is copied. (The index gives every tensor a layout:
    ``format.manifest`` refuses one without.)"""

    def __init__(self, storage: Storage, index: Manifest, codecs: Any) -> None:
        self.storage, self.index, self.codecs = storage, index, codecs
        self.refs = {r.rank: r for r in index.tables}
        self.chunk_bytes = (index.planned or {})["chunk_bytes"]
        tensors = index.tensors
        # (a layout, or None: explicit boxes, ``format.manifest`` gives every tensor of an index one or the other)
        self.layouts = [Layout(*t.layout) if t.layout is not None else None for t in tensors]
        self.metas = [(TensorMeta(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape, boxes=()), la)
                      for t, la in zip(tensors, self.layouts)]
        self.pos = {t.key: i for i, t in enumerate(tensors)}
        self.chunks: list[list[ChunkRecord]] = [list(t.chunks) for t in tensors]     # (replicated: in the index)
        self.seen: set[tuple[int, tuple[int, ...]]] = {(i, c.offsets) for i, t in enumerate(tensors) for c in t.chunks}
        self.done: set[int] = set()
        self._groups: dict[tuple[int, ...], dict[tuple[int, Box], int]] = {}
        self._holders: dict[tuple[Layout, int], tuple[int, ...]] = {}
        self._pieces: dict[tuple[int, Box], frozenset[Box]] = {}
        self._listed: dict[int, tuple[dict[tuple[int, ...], tuple[tuple[int, ...], int]], Any, Any, list[int]]] = {}

    def fresh(self) -> TableSource:
        """A ``TableSource`` of the same index with no table read, sharing this one's replay of the plan's groups
        of replicas (which member wrote each chunk, computed for all their tensors at once, and each rank's
        members): one per window of keys a tool reads (``NativeReader.read_order``), that replay made once. (Its
        size is the replicated groups' chunk count; what is per box, the pieces and explicit boxes, stays with
        each window.)"""
        other = TableSource(self.storage, self.index, self.codecs)
        other._groups, other._holders = self._groups, self._holders
        return other

    def _boxes(self, pos: int) -> tuple[dict[tuple[int, ...], tuple[tuple[int, ...], int]], Any, Any, list[int]]:
        """Tensor ``pos``'s explicit boxes: by offsets (sizes, rank), and as arrays of their first and end indices
        and their ranks (for overlap queries), made once."""
        found = self._listed.get(pos)
        if found is None:
            t = self.index.tensors[pos]
            boxes = t.boxes or ()
            first = np.array([o for _, o, _ in boxes], dtype=np.int64).reshape(len(boxes), len(t.shape))
            end = first + np.array([z for _, _, z in boxes], dtype=np.int64).reshape(first.shape)
            found = self._listed[pos] = ({o: (z, r) for r, o, z in boxes}, first, end, [r for r, _, _ in boxes])
        return found

    def _members(self, layout: Layout, rank: int) -> tuple[int, ...]:
        found = self._holders.get((layout, rank))
        if found is None:
            found = self._holders[(layout, rank)] = layout_holders(layout, rank)
        return found

    def _split(self, pos: int, held: Box) -> frozenset[Box]:
        """The chunks box ``held`` of tensor ``pos`` was cut into (computed once per box)."""
        found = self._pieces.get((pos, held))
        if found is None:
            t = self.index.tensors[pos]
            found = self._pieces[(pos, held)] = frozenset(split_box(held, t.itemsize, self.chunk_bytes))
        return found

    def _writer(self, pos: int, layout: Layout, member: int, box: Box) -> int:
        """The rank the save's plan gave chunk ``box`` of tensor ``pos``, held by ``member``'s group."""
        holders = self._members(layout, member)
        if len(holders) == 1:
            return member
        if holders not in self._groups:
            self._groups.update(group_writers(self.metas, holders[0], self.chunk_bytes))
        return self._groups[holders].get((pos, box), -1)

    def writers(self, key: str, box: Box) -> set[int]:
        """The ranks whose tables hold the chunks of ``key`` that share an element with ``box``."""
        pos = self.pos[key]
        layout = self.layouts[pos]
        t = self.index.tensors[pos]
        out: set[int] = set()
        if layout is None:                      # explicit boxes: those sharing an element with ``box``
            _, first, end, ranks = self._boxes(pos)
            if not numel(box[1]) or not ranks:
                return out
            lo = np.array(box[0], dtype=np.int64)
            hit = ((first < lo + np.array(box[1], dtype=np.int64)) & (end > lo)).all(axis=1)
            return {ranks[i] for i in np.flatnonzero(hit)}
        if replicated(layout):
            return out                          # (its chunks are in the index)
        for saved, member in overlapping(layout, t.shape, box):
            for c in self._split(pos, saved):
                if intersect(c, box) is not None:
                    out.add(self._writer(pos, layout, member, c))
        return out

    def fetch(self, ranks: set[int], keep: set[int] | None = None) -> set[int]:
        """Read the tables of ``ranks`` not read yet; the positions of the tensors that gained chunks. ``keep``:
        only the chunks of these tensors are kept (the others' are checked and dropped; reading their tables
        again is then a new ``TableSource``'s)."""
        touched: set[int] = set()
        for rank in sorted(ranks - self.done):
            for pos, rec in self.check_table(rank, keep):
                if (pos, rec.offsets) in self.seen:
                    raise CorruptCheckpointError(f"{self.storage.url}: chunk table {self.refs[rank].file!r}: tensor "
                                                 f"{self.index.tensors[pos].key!r}: the chunk at {list(rec.offsets)} "
                                                 "is listed twice; the checkpoint is damaged")
                self.seen.add((pos, rec.offsets))
                self.chunks[pos].append(rec)
                touched.add(pos)
            self.done.add(rank)
        return touched

    def estimate(self, pos: int) -> int:
        """About how many chunks tensor ``pos`` has (for windows of reads): those the index lists, its explicit
        boxes, or its bytes in chunks of ``chunk_bytes`` plus one per box of its layout."""
        t, layout = self.index.tensors[pos], self.layouts[pos]
        if t.chunks or layout is None or replicated(layout):
            return max(1, len(t.chunks), len(t.boxes or ()))
        boxes = math.prod(n for n, d in zip(layout.mesh, layout.shards) if d is not None)
        per_box = -(-t.nbytes // boxes)         # (each box cut into chunks of at most ``chunk_bytes``)
        return boxes * max(1, -(-per_box // self.chunk_bytes))

    def check_table(self, rank: int, keep: Collection[int] | None = None) -> list[tuple[int, ChunkRecord]]:
        """The chunks of ``rank``'s table, each checked to be one that rank was planned to write, listed once in
        it, its frames able to hold its blocks; nothing kept here (``fetch`` keeps them; ``verify`` streams).
        CorruptCheckpointError naming the table when it is missing, damaged or not the plan."""
        ref = self.refs.get(rank)
        if ref is None:
            raise CorruptCheckpointError(f"{self.storage.url}: rank {rank} was planned to write chunks a load "
                                         "needs, but the manifest lists no chunk table of it; the checkpoint is "
                                         "damaged")
        out, mine = [], set()
        for pos, rec in read_table(self.storage, self.index, ref, self.codecs, keep):
            problem = self._unplanned(pos, rec, rank)
            if problem is None and (pos, rec.offsets) in mine:
                problem = "is listed twice"
            if problem is None and rec.codec is not None:
                problem = frames_problem(rec)
            if problem:
                raise CorruptCheckpointError(f"{self.storage.url}: chunk table {ref.file!r}: tensor "
                                             f"{self.index.tensors[pos].key!r}: the chunk at {list(rec.offsets)} "
                                             f"{problem}; the checkpoint is damaged")
            mine.add((pos, rec.offsets))
            out.append((pos, rec))
        return out

    def _unplanned(self, pos: int, rec: ChunkRecord, rank: int) -> str | None:
        """Why chunk ``rec`` of tensor ``pos`` is not one ``rank`` was planned to write, or None."""
        layout = self.layouts[pos]
        t = self.index.tensors[pos]
        if layout is None:
            if self._boxes(pos)[0].get(rec.offsets) != (rec.sizes, rank):
                return f"is not a box the index lists for rank {rank}"
            return None
        if replicated(layout):
            return "belongs to a tensor every rank held whole, whose chunks the index lists"
        box = (rec.offsets, rec.sizes)
        held = layout_box(layout, t.shape, rank)
        if not numel(held[1]) or box not in self._split(pos, held):
            return f"is not a piece of rank {rank}'s box {held} as the save planned it"
        if self._writer(pos, layout, rank, box) != rank:
            return f"was planned for another rank of the replicas of rank {rank}"
        return None

    def entry(self, pos: int) -> TensorEntry:
        """Tensor ``pos`` with the chunks read so far (sorted by offsets)."""
        return replace(self.index.tensors[pos], chunks=tuple(sorted(self.chunks[pos], key=lambda c: c.offsets)))

    def check_covered(self, entry: TensorEntry, box: Box) -> None:
        """CorruptCheckpointError unless the chunks of ``entry`` (planned, distinct) cover ``box``."""
        got = 0
        for c in entry.chunks:
            o = intersect((c.offsets, c.sizes), box)
            got += 0 if o is None else numel(o[1])
        if got != numel(box[1]):
            raise CorruptCheckpointError(f"{self.storage.url}: tensor {entry.key!r}: the chunk tables cover "
                                         f"{got} of the {numel(box[1])} elements of box {box} a load needs; the "
                                         "checkpoint is damaged")

    def whole(self) -> None:
        """Read every table, then check that the chunks tile every tensor."""
        self.fetch(set(self.refs))
        for pos, t in enumerate(self.index.tensors):
            problem = check_chunks_tile(t.shape, [(c.offsets, c.sizes) for c in self.chunks[pos]])
            if problem:
                raise CorruptCheckpointError(f"{self.storage.url}: tensor {t.key!r}: {problem}; the checkpoint is "
                                             "damaged")
