"""Save planning: from every rank's description of what it holds to who writes which bytes where.

Pure functions on frozen data; every rank runs :func:`plan_save` on the same gathered input and gets the same
plan, so no rank has to broadcast it. Replicated chunks (plain tensors, ``Replicate()`` placements, hand-made
shards held by several ranks, identical plain values) are written once, and the bytes to write are balanced
across the ranks that hold them (largest chunk first, to the holder with the fewest bytes so far).

A plain tensor is replicated only if its copies are equal: every rank sends the digest of each plain tensor it
holds (``RankMeta.digests``), and one whose copies differ is stored per rank (:func:`per_rank_keys`): as a
tensor with one more leading dimension, one index per holding rank, each rank writing its own row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from liferaft.errors import InvalidStateError
from liferaft.format.checks import tree_problem
from liferaft.format.layout import data_file_name
from liferaft.format.manifest import (
    DTYPE_ITEMSIZE,
    ChunkRecord,
    ContainerEntry,
    Manifest,
    PathPart,
    TensorEntry,
    ValueEntry,
)
from liferaft.planning.geometry import Box, check_chunks_tile, in_bounds, numel, split_box

#: Largest chunk a save writes: boxes beyond it are cut into row-major runs of at most this many bytes, so that
#: an incremental save can skip the unchanged parts of a partly changed tensor and the writes spread evenly.
DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class TensorMeta:
    """What one rank holds of one global tensor: its local boxes (usually one)."""

    key: str
    path: tuple[PathPart, ...]
    kind: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    #: stored per rank: the holding ranks whose copies differed, one per index of dimension 0 (``shape`` and
    #: ``boxes`` are then those of the stored tensor)
    per_rank: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ValueMeta:
    """A plain value as this rank encoded it (tagged JSON) and a digest to compare across ranks cheaply."""

    key: str
    path: tuple[PathPart, ...]
    encoded: Any
    digest: str


@dataclass(frozen=True)
class RankMeta:
    rank: int
    tensors: tuple[TensorMeta, ...]
    values: tuple[ValueMeta, ...]
    containers: tuple[ContainerEntry, ...]
    #: (key, xxh3 digest of its bytes) for each plain tensor this rank holds that must be equal on every rank
    digests: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WriteItem:
    """One chunk this rank writes: the box of tensor ``key`` to ``file`` (``byte_offset``: its place when every
    chunk is stored raw; the writer lays out what it actually writes). ``parent`` is the box this rank holds
    that the chunk was cut from (None: the chunk is that box)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    length: int
    parent: Box | None = None


@dataclass(frozen=True)
class SavePlan:
    world_size: int
    writes: tuple[tuple[WriteItem, ...], ...]       # indexed by rank
    files: Mapping[str, int]                        # file name -> final size in bytes
    tensors: tuple[TensorMeta, ...]                 # global entries (boxes = distinct chunks), manifest order
    values: tuple[ValueEntry, ...]
    containers: tuple[ContainerEntry, ...]
    #: planned by each rank on its own (``planning.layouts``): only this rank's writes are here, and rank 0
    #: gathers the others' with what they stored
    own: bool = False

    def bytes_for_rank(self, rank: int) -> int:
        return sum(w.length for w in self.writes[rank])

    @property
    def per_rank(self) -> dict[str, tuple[int, ...]]:
        return {t.key: t.per_rank for t in self.tensors if t.per_rank is not None}


def per_rank_keys(metas: Sequence[RankMeta]) -> dict[str, tuple[int, ...]]:
    """The plain tensors whose copies differ between the ranks holding them (by digest), each with its holding
    ranks in order: what a save stores per rank."""
    seen: dict[str, dict[int, str]] = {}
    for m in metas:
        for key, d in m.digests:
            seen.setdefault(key, {})[m.rank] = d
    return {k: tuple(sorted(ds)) for k, ds in seen.items() if len(set(ds.values())) > 1}


def _stored_per_rank(metas: Sequence[RankMeta], per_rank: Mapping[str, tuple[int, ...]]) -> list[RankMeta]:
    """``metas`` with each per-rank tensor described as stored: ``[holders, *shape]``, the rank's copy in its row."""
    if not per_rank:
        return list(metas)
    out = []
    for m in metas:
        tensors = []
        for t in m.tensors:
            ranks = per_rank.get(t.key)
            if ranks is not None:
                full = (tuple(0 for _ in t.shape), t.shape)
                if t.boxes != (full,):
                    raise InvalidStateError(f"key {t.key!r}: differs between ranks but rank {m.rank} holds only a "
                                            "part of it; a tensor stored per rank must be whole on each rank")
                row = ranks.index(m.rank)
                t = replace(t, shape=(len(ranks),) + t.shape, per_rank=ranks,
                            boxes=(((row,) + full[0], (1,) + t.shape),))
            tensors.append(t)
        out.append(replace(m, tensors=tuple(tensors)))
    return out


PAGE = 4096
#: Chunks this large start ``PAGE_PHASE`` bytes into a 4 KiB page (``place``), as the staging pool places their
#: pieces (``staging.stager.DIRECT_MIN``, the same number), so that their whole pages go to storage with O_DIRECT.
#: (Until 2026-12-07 it was 1 MiB while the pool placed pieces from 64 KiB on a page: chunks of 512 KiB to 1 MiB,
#: such as the halves of 512 x 512 fp32 matrices sharded over 2 ranks, went through the page cache and a slow
#: fsync.) Smaller chunks stay at the alignment, back to back: each alone as an O_DIRECT request (one in flight)
#: was slower here than through the page cache and one fsync (measured: 300 x 100 KB 0.16 s against 0.085, 150 x
#: 256 KiB 0.12-0.13 against 0.09-0.11; 250 x 450 KB even; 200 x 600 KB 0.137 against 0.17). At most ``PAGE``
#: bytes of gap per large chunk: ≤ 0.8 %.
PAGE_ALIGN_MIN = 512 << 10
#: Where in a page a large chunk starts: the offset within a page of a large host tensor's memory as torch's CPU
#: allocator hands it out (a 64-byte aligned block of an mmap-ed region: one cache line past a page boundary), so
#: that a synchronous save writes such a tensor with O_DIRECT straight from its memory, uncopied
#: (``core.chunks.writer``); the staging pool's pieces are placed alike. A constant: the same state gives the same
#: files on every save path, whatever the addresses.
PAGE_PHASE = 64


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def page_phase(alignment: int) -> int:
    """Where in a page ``place`` starts large chunks for ``alignment``: ``PAGE_PHASE``, or 0 above it (pure)."""
    return PAGE_PHASE if alignment <= PAGE_PHASE else 0


def place(pos: int, nbytes: int, alignment: int) -> int:
    """The file position of a chunk of ``nbytes`` laid out after ``pos`` (pure): the next multiple of ``alignment``;
    a chunk of ``PAGE_ALIGN_MIN`` bytes or more starts ``PAGE_PHASE`` bytes into the next page (``alignment`` at
    most ``PAGE_PHASE``: a larger one keeps its chunks on a page)."""
    if nbytes < PAGE_ALIGN_MIN:
        return _align(pos, alignment)
    if alignment > PAGE_PHASE:
        return _align(pos, max(alignment, PAGE))
    return _align(max(0, pos - PAGE_PHASE), PAGE) + PAGE_PHASE


def plan_save(metas: Sequence[RankMeta], save_id: str, alignment: int = 64,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> SavePlan:
    """Build the global save plan. Raises InvalidStateError for inconsistent or overlapping input.

    Each distinct box is cut into chunks of at most ``chunk_bytes`` (``geometry.split_box``), each written by
    one of the box's holders (largest first, to the least-loaded holder).

    Plain values and plain tensors are stored once if every rank holds the same, else per rank; containers are
    merged."""
    world = len(metas)
    if [m.rank for m in metas] != list(range(world)):
        raise InvalidStateError("rank metadata must be given for ranks 0..N-1 in order")
    metas = _stored_per_rank(metas, per_rank_keys(metas))
    # ---- merge tensor metadata across ranks
    first: dict[str, TensorMeta] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    order: list[str] = []
    for m in metas:
        for t in m.tensors:
            if t.dtype not in DTYPE_ITEMSIZE:
                raise InvalidStateError(f"key {t.key!r}: dtype {t.dtype} cannot be saved")
            f = first.get(t.key)
            if f is None:
                first[t.key] = t
                order.append(t.key)
            elif (f.shape, f.dtype, f.kind, f.path, f.per_rank) != (t.shape, t.dtype, t.kind, t.path, t.per_rank):
                raise InvalidStateError(
                    f"key {t.key!r}: rank {m.rank} holds global shape {list(t.shape)} {t.dtype} but another rank "
                    f"holds {list(f.shape)} {f.dtype}; every rank must describe the same global tensor")
            for box in t.boxes:
                if not in_bounds(box, t.shape):
                    raise InvalidStateError(
                        f"key {t.key!r}: rank {m.rank} holds a shard at offsets {list(box[0])} with sizes "
                        f"{list(box[1])} that lies outside the global shape {list(t.shape)}")
                holders.setdefault((t.key, box), []).append(m.rank)
    tensors: list[TensorMeta] = []
    by_key: dict[str, list[Box]] = {k: [] for k in order}
    for (k, b) in holders:
        by_key[k].append(b)
    for key in order:
        f = first[key]
        boxes = tuple(sorted(by_key[key]))
        problem = check_chunks_tile(f.shape, boxes)
        if problem:
            raise InvalidStateError(f"key {key!r}: {problem}; shards on save must tile the global tensor exactly "
                                    "(identical replicas are fine)")
        tensors.append(TensorMeta(key=key, path=f.path, kind=f.kind, dtype=f.dtype, shape=f.shape,
                                  boxes=tuple(b for b in boxes if numel(b[1]) > 0), per_rank=f.per_rank))
    # ---- assign each distinct chunk to one holder, largest first, to the least-loaded holder
    jobs = []
    for t in tensors:
        isz = DTYPE_ITEMSIZE[t.dtype]
        for held in t.boxes:
            for box in split_box(held, isz, chunk_bytes):
                jobs.append((numel(box[1]) * isz, t.key, box, held))
    jobs.sort(key=lambda j: (-j[0], j[1], j[2]))
    load = [0] * world
    assigned: list[list[tuple[str, Box, int, Box]]] = [[] for _ in range(world)]
    for nbytes, key, box, held in jobs:
        cands = holders[(key, held)]
        rank = min(cands, key=lambda r: (load[r], r))
        load[rank] += nbytes
        assigned[rank].append((key, box, nbytes, held))
    # ---- lay chunks out in each rank's file (manifest order for locality)
    key_pos = {k: i for i, k in enumerate(order)}
    writes: list[tuple[WriteItem, ...]] = []
    files: dict[str, int] = {}
    for rank in range(world):
        items = sorted(assigned[rank], key=lambda a: (key_pos[a[0]], a[1]))
        fname = data_file_name(save_id, rank)
        pos, out = 0, []
        for key, box, nbytes, held in items:
            pos = place(pos, nbytes, alignment)
            out.append(WriteItem(key=key, offsets=box[0], sizes=box[1], file=fname, byte_offset=pos, length=nbytes,
                                 parent=None if held == box else held))
            pos += nbytes
        if out:
            files[fname] = pos
        writes.append(tuple(out))
    values, containers = tuple(merge_values(metas)), merge_containers(metas)
    problem = tree_problem(tensors, values, containers)
    if problem:             # (what a reader would refuse: refused before anything is written)
        raise InvalidStateError(f"the ranks' states conflict: {problem}; nothing was written")
    return SavePlan(world_size=world, writes=tuple(writes), files=files, tensors=tuple(tensors),
                    values=values, containers=containers)


def replan(previous: SavePlan, metas: Sequence[RankMeta], save_id: str) -> SavePlan:
    """The plan for a save whose tensor metadata (every rank's ``RankMeta.tensors``) equals that of the save
    ``previous`` was planned for: its tensor layout, with this save's file names, values and containers."""
    writes = tuple(tuple(replace(w, file=data_file_name(save_id, rank)) for w in items)
                   for rank, items in enumerate(previous.writes))
    files = {data_file_name(save_id, rank): items[-1].byte_offset + items[-1].length
             for rank, items in enumerate(writes) if items}
    return SavePlan(world_size=previous.world_size, writes=writes, files=files, tensors=previous.tensors,
                    values=tuple(merge_values(metas)), containers=merge_containers(metas), own=previous.own)


def merge_containers(metas: Sequence[RankMeta]) -> tuple[ContainerEntry, ...]:
    containers: dict[tuple, ContainerEntry] = {}
    for m in metas:
        for c in m.containers:
            prev = containers.setdefault(c.path, c)
            if prev.kind != c.kind:
                raise InvalidStateError(f"path {list(c.path)}: rank {m.rank} holds a {c.kind} where another rank "
                                        f"holds a {prev.kind}")
            if prev is not c and c.children and prev.children != c.children:
                # ranks may hold different children (pipeline stages): keep rank order of first appearance
                known = set(prev.children or ())
                merged = tuple(prev.children or ()) + tuple(k for k in c.children if k not in known)
                containers[c.path] = replace(prev, children=merged)
    return tuple(containers.values())


def merge_values(metas: Sequence[RankMeta]) -> list[ValueEntry]:
    seen: dict[str, list[ValueMeta | None]] = {}
    order: list[str] = []
    for m in metas:
        for v in m.values:
            if v.key not in seen:
                seen[v.key] = [None] * len(metas)
                order.append(v.key)
            seen[v.key][m.rank] = v
    out = []
    for key in order:
        per = seen[key]
        present = [v for v in per if v is not None]
        if all(v is not None and v.digest == present[0].digest for v in per):
            out.append(ValueEntry(key=key, path=present[0].path, value=present[0].encoded))
        else:
            out.append(ValueEntry(key=key, path=present[0].path, per_rank=tuple(
                v.encoded if v is not None else None for v in per),
                held=tuple(r for r, v in enumerate(per) if v is not None) if None in per else None))
    return out


def chunk_record(w: WriteItem, sc: Any) -> ChunkRecord:
    """The record of write ``w`` as its writer stored it (``sc``, a ``StoredChunk``)."""
    return ChunkRecord(offsets=w.offsets, sizes=w.sizes, file=sc.file, byte_offset=sc.byte_offset, length=w.length,
                       block_size=sc.block_size, hashes=tuple(sc.hashes), codec=sc.codec, frames=sc.frames,
                       delta=sc.delta, checksum=sc.checksum, digest=sc.digest)


def build_manifest(plan: SavePlan, stored: Sequence[Sequence[Any]], file_sizes: Sequence[int], *, save_id: str,
                   created_unix: float, liferaft_version: str, torch_version: str,
                   extra: Mapping[str, Any] | None = None, lossy: Mapping[str, Mapping[str, Any]] | None = None
                   ) -> Manifest:
    """Combine the plan with what each rank's writer did: ``stored[rank][i]`` describes ``plan.writes[rank][i]``
    (a ``transfer.writer.StoredChunk``: file, byte offset, block size, hashes, codec, frames, delta base, sizes
    of the other checkpoints' files it needs, lossy error) and ``file_sizes[rank]`` is the size of that rank's
    data file (0: it wrote none).
    ``lossy``: key → what the caller asked to lose (``{"method": ...}``); the measured errors are added."""
    records: dict[str, list[ChunkRecord]] = {t.key: [] for t in plan.tensors}
    files: dict[str, int] = {}
    errors: dict[str, list[float]] = {}
    stale: dict[str, dict[str, Any]] = {}
    for rank, items in enumerate(plan.writes):
        if len(stored[rank]) != len(items):
            raise InvalidStateError(f"rank {rank} reported {len(stored[rank])} stored chunks for {len(items)} writes")
        if file_sizes[rank]:
            files[data_file_name(save_id, rank)] = file_sizes[rank]
        for w, sc in zip(items, stored[rank]):
            files.update(sc.ref_files or {})
            records[w.key].append(chunk_record(w, sc))
            if sc.error is not None:
                e = errors.setdefault(w.key, [0.0, 0.0, 0])
                e[0], e[1], e[2] = max(e[0], sc.error[0]), e[1] + sc.error[1], e[2] + sc.error[2]
            if sc.stale is not None:
                st = stale.setdefault(w.key, {"method": "selective", "chunks": 0, "max_change": 0.0, "from": []})
                st["chunks"] += 1
                st["max_change"] = max(st["max_change"], sc.stale)
                src = sc.file.split("/")[1] if sc.file.startswith("../") else (sc.origin or save_id)
                st["from"] = sorted(set(st["from"]) | {src})
    lossy_out: dict[str, dict[str, Any]] = {}
    for key, how in (lossy or {}).items():
        if key in errors:
            e = errors[key]
            lossy_out[key] = {**how, "max_abs_error": e[0], "mean_abs_error": e[1] / max(e[2], 1)}
    for key, st in stale.items():                   # selective: chunks not saved at this step
        lossy_out[key] = {**st, "threshold": (lossy or {}).get(key, {}).get("threshold"),
                          "of_chunks": len(records[key])}
    tensors = tuple(TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape,
                                chunks=tuple(sorted(records[t.key], key=lambda c: c.offsets)),
                                lossy=lossy_out.get(t.key), per_rank=t.per_rank) for t in plan.tensors)
    return Manifest(save_id=save_id, world_size=plan.world_size, created_unix=created_unix,
                    liferaft_version=liferaft_version, torch_version=torch_version, files=files,
                    tensors=tensors, values=plan.values, containers=plan.containers, extra=dict(extra or {}))
