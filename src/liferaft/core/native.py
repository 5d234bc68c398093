"""liferaft's own format as a :class:`formats.base.Reader`: the committed manifest (``core.commit.open_checkpoint``)
and chunk reads that are coalesced, shared between ranks on remote storage and verified block by block
(``core.chunks.reader``). The one reader whose bytes are ``verified``.

What only this format records reaches the tools through the reader, never by reopening the manifest:
``chunks(key)`` (each chunk's codecs, file, stored bytes, writing rank, references), ``info`` (version, save id,
files, ``metadata`` — the manifest's ``extra`` —, ``containers``) and the documented attributes ``manifest`` (the
verified ``format.manifest.Manifest``, read-only) and ``storage`` (where it lies, references resolved)."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from liferaft.core.chunks.blocks import read_blocks
from liferaft.core.chunks.reader import execute_reads
from liferaft.core.commit import check_files
from liferaft.core.tabled import TableSource
from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.format.manifest import ChunkRecord, Manifest, TensorEntry, ValueEntry
from liferaft.formats.base import (
    BoxRead,
    CheckReport,
    ChunkInfo,
    Reader,
    ReadJob,
    ReadOutcome,
    TensorSpec,
    ValueSpec,
)
from liferaft.options import LoadOptions
from liferaft.planning.geometry import Box, numel
from liferaft.planning.load_plan import plan_reads
from liferaft.state.tree import build_tree
from liferaft.state.values import PerRank, decode_value
from liferaft.storage import Storage
from liferaft.storage.base import read_size_of


def decode_entry_value(v: ValueEntry, allow_pickle: bool) -> Any:
    """A manifest's plain value, decoded; a ``PerRank`` for one that differed between the saving ranks."""
    if v.per_rank is None:
        return decode_value(v.value, v.key, allow_pickle)
    out = PerRank(decode_value(x, v.key, allow_pickle) for x in v.per_rank)
    out.held = v.held
    return out


def _spec(e: TensorEntry) -> TensorSpec:
    return TensorSpec(key=e.key, dtype=e.dtype, shape=tuple(e.shape), kind=e.kind, path=tuple(e.path),
                      per_rank=e.per_rank, lossy=e.lossy, boxes=tuple((c.offsets, c.sizes) for c in e.chunks),
                      nbytes=e.nbytes)


#: Chunk records a reader with a ``read_order`` keeps at a time (``NativeReader.read_order``): a record of a 16 MiB
#: chunk with 128 KiB blocks takes a few kB in memory.
WINDOW_CHUNKS = 1 << 18

#: The data files of a save are ``data/<save id>/r<rank>.bin``: the rank that wrote a chunk, from its file name.
_WRITER = re.compile(r"/r(\d+)\.bin$")


class NativeReader(Reader):
    """A committed liferaft checkpoint in ``storage`` (with references to sibling checkpoints resolved), read
    through its verified ``manifest``. ``manifest``, ``storage`` and ``entries`` (the manifest's tensor entries by
    key) are read-only; each data file is checked present and long enough once per reader (``check_present``, or
    the first ``plan`` that reads from it), not again for every read.

    ``tables``: the chunk tables of a version 4 ``manifest`` given as its index (docs/FORMAT.md §4.6), read as
    the boxes planned need them (``core.tabled.TableSource``): ``entries`` then hold the chunks read so far, and
    ``manifest`` stays the index."""

    def __init__(self, storage: Storage, manifest: Manifest, options: LoadOptions | None = None,
                 tables: TableSource | None = None, read_size: int | None = None) -> None:
        self.storage, self.manifest = storage, manifest
        opts = options or LoadOptions()
        #: the options, ``max_read_bytes`` resolved where None: ``read_size`` (the ranks' agreed size,
        #: ``core.open``), else the storage's (``Storage.read_size``)
        self.options = opts if opts.max_read_bytes is not None else \
            dataclasses.replace(opts, max_read_bytes=read_size or read_size_of(storage))
        self.entries = manifest.tensor_map()
        self._tables = tables
        self._values = {v.key: v for v in manifest.values}
        self._checked: set[str] = set()             # data files found present and long enough
        #: (``read_order``) the tools' order of the keys, the most chunk records kept at a time, the keys whose
        #: chunks are held (one window) and the windows read so far
        self._order: dict[str, int] | None = None
        self._window_chunks = WINDOW_CHUNKS
        self._held: set[str] = set()
        self.windows = 0
        self._window_reads = 0
        self._resolving = threading.RLock()     # (the tools read the next slab in a thread of their own)
        m = manifest
        super().__init__(
            url=storage.url, fmt="liferaft", verified=True, world_size=m.world_size,
            tensors={e.key: _spec(e) for e in m.tensors},
            values={v.key: ValueSpec(key=v.key, path=tuple(v.path), per_rank=v.per_rank is not None)
                    for v in m.values},
            classes={c.path: c.cls for c in m.containers if c.kind == "stateful"},
            info={"format_version": m.version, "save_id": m.save_id, "created_unix": m.created_unix,
                  "liferaft_version": m.liferaft_version, "torch_version": m.torch_version,
                  "files": dict(m.files), "metadata": dict(m.extra),
                  "containers": [(c.path, c.kind, c.children, c.cls) for c in m.containers]})

    @property
    def tables_read(self) -> int | None:
        """Chunk tables read so far (None: the manifest lists every chunk, or was opened whole)."""
        return None if self._tables is None else len(self._tables.done) + self._window_reads

    def read_order(self, keys: Sequence[str], window_chunks: int | None = None) -> bool:
        """(``Reader.read_order``) With chunk tables not read yet: the tensors ``keys`` will be read in this order,
        each whole or in slabs. Their chunks are then read in windows of consecutive keys holding about
        ``window_chunks`` chunk records (default ``WINDOW_CHUNKS``), each window's tables read once and only its
        keys' records kept, the previous window's dropped: memory holds one window, whatever the checkpoint's
        size, for one read of the tables per window (a key read out of order costs its window's reads again)."""
        if self._tables is None or self._tables.done:
            return False
        self._order = {k: i for i, k in enumerate(k for k in dict.fromkeys(keys) if k in self.entries)}
        if window_chunks is not None:
            self._window_chunks = max(1, window_chunks)
        return True

    def _window(self, first: str) -> list[str]:
        """The keys of the window starting at ``first`` in ``read_order``: as many as fit ``_window_chunks`` by
        their estimated chunk counts (at least one)."""
        assert self._order is not None and self._tables is not None
        keys = sorted(self._order, key=self._order.__getitem__)[self._order[first]:]
        out, held = [], 0
        for k in keys:
            n = self._tables.estimate(self._tables.pos[k])
            if out and held + n > self._window_chunks:
                break
            out.append(k)
            held += n
        return out

    def _resolve(self, wanted: Iterable[tuple[str, Box | None]]) -> dict[str, TensorEntry]:
        """(Chunk tables) Read the tables holding the chunks of the ``(key, box)`` wanted (None: the whole
        tensor), fill ``entries`` with them and check each box covered. With a ``read_order``, whole windows of
        keys, dropping the chunks of the window before. Returns the entries of the keys wanted, as resolved (a read
        plans from these: another thread's next window may drop them from ``entries`` meanwhile)."""
        wanted = list(wanted)
        src = self._tables
        if src is None:
            return {k: self.entries[k] for k, _ in wanted}
        with self._resolving:
            self._resolve_locked(src, wanted)
            return {k: self.entries[k] for k, _ in wanted}

    def _resolve_locked(self, src: TableSource, wanted: Iterable[tuple[str, Box | None]]) -> None:
        wanted = [(k, b if b is not None else (tuple(0 for _ in self.entries[k].shape), self.entries[k].shape))
                  for k, b in wanted]
        if self._order is not None:
            self._resolve_windows(wanted)
            return
        ranks: set[int] = set()
        for key, box in wanted:
            ranks |= src.writers(key, box)
        for pos in src.fetch(ranks):
            entry = src.entry(pos)
            self.entries[entry.key] = entry
        for key, box in wanted:
            if numel(box[1]):
                src.check_covered(self.entries[key], box)

    def _resolve_windows(self, wanted: list[tuple[str, Box]]) -> None:
        """``_resolve`` in ``read_order``'s windows: wanted keys not held start a window from the first of them
        in the order, holding every key wanted (one the tool did not announce too): every table its keys need
        read once by a ``TableSource`` of its own (sharing the plan's replay: ``TableSource.fresh``), only their
        records kept. Once it is read, the keys of the window before go back to the index's entries."""
        assert self._tables is not None and self._order is not None
        order = self._order
        missing = list(dict.fromkeys(k for k, _ in wanted if k not in self._held))
        if missing:
            announced = sorted((k for k in missing if k in order), key=order.__getitem__)
            keys = self._window(announced[0]) if announced else []
            keys += [k for k in missing if k not in set(keys)]
            src = self._tables.fresh()
            positions = {src.pos[k] for k in keys}
            ranks: set[int] = set()
            for k in keys:
                e = self.manifest.tensors[src.pos[k]]
                ranks |= src.writers(k, (tuple(0 for _ in e.shape), e.shape))
            src.fetch(ranks, keep=positions)        # (a failure here leaves the window before as it was)
            for k in self._held - set(keys):
                self.entries[k] = self.manifest.tensors[src.pos[k]]
            for k in keys:
                self.entries[k] = src.entry(src.pos[k])
            self._held = set(keys)
            self.windows += 1
            self._window_reads += len(src.done)
        for key, box in wanted:
            if numel(box[1]):
                self._tables.check_covered(self.entries[key], box)

    def value(self, key: str) -> Any:
        return decode_entry_value(self._values[key], self.options.allow_pickle)

    def plan(self, requests: Sequence[BoxRead]) -> ReadJob:
        return _NativeJob(self, requests)

    def copy_box(self, key: str, offsets: Sequence[int], out: torch.Tensor) -> int:
        return self.plan([(key, (tuple(offsets), tuple(out.shape)), out)]).run().used

    def chunks(self, key: str) -> tuple[ChunkInfo, ...]:
        """Each chunk of ``key`` as saved: its codec (``"raw"`` for none) and ``"xor-delta"`` when it is stored
        as a delta, its file (relative to the checkpoint; ``../<sibling>/...`` for a reference), the bytes it
        takes there, the rank whose file holds it."""
        return tuple(chunk_info(c) for c in self._resolve([(key, None)])[key].chunks)

    def chunk_infos(self, keys: Iterable[str]) -> Iterator[tuple[str, ChunkInfo]]:
        """(``Reader.chunk_infos``) With chunk tables not read yet, streamed by ``stream_chunks``."""
        if not self.streams:
            yield from super().chunk_infos(keys)
            return
        for key, c in self.stream_chunks(keys):
            yield key, chunk_info(c)

    @property
    def streams(self) -> bool:
        """Whether the chunks of sharded tensors live in chunk tables not read yet (a version 4 checkpoint opened
        with ``lazy``): ``stream_chunks`` then reads them one table at a time."""
        return self._tables is not None and not self._tables.done

    def stream_chunks(self, keys: Iterable[str]) -> Iterator[tuple[str, ChunkRecord]]:
        """Every chunk of the tensors ``keys``, with its key: those the index lists, then each table's, one table
        in memory at a time, each checked as a load checks it (``TableSource.check_table``: only chunks its rank
        was planned to write, each once, so the chunks of a tensor are disjoint), nothing kept. Raises
        CorruptCheckpointError naming the table when one is missing or damaged, and naming the tensor when the
        tables do not hold all of its elements (what ``chunks`` checks by their tiling)."""
        m, src = self.manifest, self._tables
        wanted = set(keys)
        pos = {i for i, t in enumerate(m.tensors) if t.key in wanted}
        held = dict.fromkeys(pos, 0)
        for i in sorted(pos):
            for c in m.tensors[i].chunks:
                held[i] += numel(c.sizes)
                yield m.tensors[i].key, c
        if src is not None:
            for rank in sorted(src.refs):
                for i, c in src.check_table(rank):
                    if i in pos:
                        held[i] += numel(c.sizes)
                        yield m.tensors[i].key, c
        for i, n in held.items():
            if n != numel(m.tensors[i].shape):
                raise CorruptCheckpointError(f"{self.storage.url}: tensor {m.tensors[i].key!r}: its chunks hold {n} of "
                                             f"its {numel(m.tensors[i].shape)} elements: chunks are missing from its "
                                             "chunk tables; the checkpoint is damaged")

    def check_present(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self._order is not None:     # (the tables streamed once, nothing kept: the reads resolve by windows)
            self._check({c.file for _, c in self.stream_chunks(keys)})
            return
        entries = self._resolve([(k, None) for k in keys])
        self._check({c.file for e in entries.values() for c in e.chunks})

    def held_elsewhere(self, files: Iterable[str]) -> None:
        """Files this rank cannot read but receives from the ranks that hold them (``core.load.load_held``): not
        checked here; their holders read them, and every block received is verified here."""
        self._checked |= set(files)

    def _check(self, files: set[str]) -> None:
        """``core.commit.check_files`` for the files not yet checked by this reader."""
        todo = files - self._checked
        if todo:
            check_files(self.storage, self.manifest, todo)
            self._checked |= todo

    def tree(self, leaves: Mapping[str, Any]) -> Any:
        m = self.manifest
        paths = {e.key: e.path for e in [*m.tensors, *m.values]}
        by_path = {paths[k]: v for k, v in leaves.items()}
        kinds = {c.path: c.kind for c in m.containers}
        if len(leaves) < len(paths):            # only the containers on the way to the leaves asked for
            needed = {p[:i] for p in by_path for i in range(len(p))}
            kinds = {p: k for p, k in kinds.items() if p in needed}
        orders = {c.path: c.children for c in m.containers if c.children is not None}
        return build_tree(kinds, by_path, orders)

    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        """Every data file present with the size the manifest records, and every block of every chunk re-hashed
        (``max_read_bytes`` at a time). Opened with its chunk ``tables`` (version 4, not read yet), the tables are
        streamed: each is read, checked against the plan (``TableSource.check_table``), its chunks re-hashed and
        dropped, so memory holds one table at a time; a damaged table is a fault and the others are still
        checked; the chunks read must then hold every element of every tensor (the planned pieces are disjoint:
        their count is their tiling)."""
        storage, m = self.storage, self.manifest
        faults: list[str] = []
        refused: set[str] = set()
        for name, size in m.files.items():
            try:
                actual = storage.size(name)
            except FileNotFoundError:
                faults.append(f"data file {name!r} is missing")
                continue
            except LiferaftError as e:          # a link, a FIFO, a folder: refused, never read
                faults.append(f"data file {name!r}: {e}")
                refused.add(name)
                continue
            if actual != size:
                faults.append(f"data file {name!r} has {actual} bytes, the manifest says {size}")
        done = [0, 0]                               # chunks, bytes checked

        def check_chunks(chunks: Iterable[tuple[TensorEntry, ChunkRecord]]) -> None:
            for t, c in chunks:
                done[0] += 1
                if c.file in refused:
                    continue
                per_read = max(1, self.options.max_read_bytes // c.block_size)
                for first in range(0, len(c.hashes), per_read):
                    end = min(len(c.hashes), first + per_read)
                    try:
                        got = len(read_blocks(storage, c, first, end, t.dtype, t.key))
                        done[1] += got
                        if progress is not None:
                            progress(got)
                    except LiferaftError as e:
                        if "is missing" not in str(e):          # (missing files are reported above)
                            faults.append(str(e))
                        break

        check_chunks((t, c) for t in m.tensors for c in t.chunks)       # (with tables: those held whole)
        src = self._tables
        if src is not None:
            held = [0] * len(m.tensors)
            bad = 0
            for rank in sorted(src.refs):
                try:
                    chunks = src.check_table(rank)
                except LiferaftError as e:
                    faults.append(str(e))
                    bad += 1
                    continue
                for pos, c in chunks:
                    held[pos] += numel(c.sizes)
                check_chunks((m.tensors[pos], c) for pos, c in chunks)
            short = [(t.key, n, numel(t.shape)) for t, n in zip(m.tensors, held)
                     if not t.held_whole and n != numel(t.shape)]
            if short and bad:
                faults.append(f"{len(short)} tensor(s) lack the elements of the {bad} chunk table(s) that could not "
                              "be read")
            elif short:
                faults.extend(f"tensor {k!r}: the chunk tables hold {n} of its {total} elements (a table is missing "
                              "or lacks chunks)" for k, n, total in short)
        return CheckReport(path=storage.url, fmt=self.fmt, units=done[0], checked_bytes=done[1], bytes_read=done[1],
                           faults=tuple(faults))


def chunk_info(c: ChunkRecord) -> ChunkInfo:
    """How chunk ``c`` is stored, as ``Reader.chunks`` reports it: its codec (``"raw"`` for none) and
    ``"xor-delta"`` when it is stored as a delta, its file, the bytes it takes there, the rank whose file holds it."""
    found = _WRITER.search(c.file)
    return ChunkInfo(offsets=tuple(c.offsets), sizes=tuple(c.sizes), file=c.file,
                     codecs=(c.codec or "raw",) + (("xor-delta",) if c.delta is not None else ()),
                     stored_bytes=c.stored_length, rank=int(found.group(1)) if found else None,
                     referenced=c.is_reference)


class _NativeJob(ReadJob):
    """The reads of a native load: per box, the planned byte ranges of the chunks it overlaps
    (``planning.load_plan.plan_reads``), their files checked present and long enough at once (those the reader
    has not checked before)."""

    def __init__(self, reader: NativeReader, requests: Sequence[BoxRead]) -> None:
        super().__init__(reader, requests)
        self.native = reader
        self.targets: list[torch.Tensor] = []
        self.units: list[Any] = []
        files: set[str] = set()
        max_read = reader.options.max_read_bytes
        entries = reader._resolve((key, box) for key, box, _ in self.requests)
        for key, box, dest in self.requests:
            self.targets.append(dest)
            units = plan_reads(entries[key], [(len(self.targets) - 1, box)], max_read)
            self.units.extend((u, dest.dtype) for u in units)
            files.update(u.file for u in units)
        reader._check(files)
        # every span, with its bytes once decoded (a compressed span is decoded once); each way of sharing keeps
        # those worth it (``core.load``, ``planning.share_plan``)
        self.span_bytes = {(u.file, u.file_offset, u.length): u.decoded_length if u.codec is not None else u.length
                           for u, _ in self.units}
        self.spans = list(self.span_bytes)

    def run(self, *, check_only: bool = False, peers: Any = None, rank: int = 0,
            sharing: Mapping[Any, Any] | None = None, host: Any = None) -> ReadOutcome:
        stats = execute_reads(self.native.storage, self.units, self.targets, copy=not check_only,
                              max_read=self.native.options.max_read_bytes, peers=peers, rank=rank,
                              sharing=sharing or {}, host=host)
        return ReadOutcome(used=stats.used, received=stats.received, verify_s=stats.verify_s)
