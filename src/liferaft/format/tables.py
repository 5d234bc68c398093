"""Chunk tables (format version 4, docs/FORMAT.md §4.6): one small JSON file per writing rank holding the records
of the chunks of its data file, so that the manifest (the index: tensors, their layouts, files, values) grows
with the tensors and the ranks, not with the chunks, and nobody gathers every chunk's record to commit.

``encode_table`` is what a rank writes; ``decode_table`` reads one back, checked against the index that pins it
(its bytes' digest, its rank, and every chunk through the manifest's own chunk checks, each in its writer's data
file). Pure: no I/O, no torch; ``core.tabled`` reads tables and checks their chunks against the plan.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping, Sequence

from liferaft.format import jsonsafe
from liferaft.format.layout import copies_file_name, data_file_name
from liferaft.format.limits import MAX_MANIFEST_BYTES
from liferaft.format.manifest import _chunk_fast, _decode_chunk, _fail
from liferaft.format.records import CHECKSUM_ALGO, LEGACY_CHECKSUM, ChunkRecord, Manifest, TableRef

TABLE_FORMAT = "liferaft-chunks"
TABLE_VERSION = 1


def encode_table(save_id: str, rank: int, chunks: Sequence[tuple[int, ChunkRecord]]) -> bytes:
    """The bytes of rank ``rank``'s chunk table for save ``save_id``: ``chunks`` as (index of the tensor in the
    manifest, record), in that order."""
    doc = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "save_id": save_id, "rank": rank,
           "checksum": CHECKSUM_ALGO, "chunks": [[i, c.to_json(CHECKSUM_ALGO)] for i, c in chunks]}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode_table(data: bytes, ref: TableRef, index: Manifest, codecs: Collection[str] | None = None,
                 keep: Collection[int] | None = None) -> list[tuple[int, ChunkRecord]]:
    """The chunks of the table ``ref`` of ``index`` from its bytes ``data``, whose digest the caller compared
    with ``ref.hash``. Every chunk is checked as a manifest's chunk is (§9), is no delta, names a tensor of the
    index and lies in rank ``ref.rank``'s data file, or (version 6: an incremental save) in that rank's file of
    copied chunks or in a file of another checkpoint that the index lists; the count must be ``ref.chunks``.
    Raises CorruptCheckpointError. ``keep``: only the chunks of these tensors are decoded and checked (the
    others' are counted and their tensor index checked: a reader keeping some tensors checks the rest when it
    keeps them)."""
    where = f"chunk table {ref.file!r}"
    doc = jsonsafe.loads(data, where, MAX_MANIFEST_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT or doc.get("version") != TABLE_VERSION:
        raise _fail(where, f"not a version {TABLE_VERSION} {TABLE_FORMAT} document")
    if doc.get("save_id") != index.save_id or type(doc.get("rank")) is not int or doc.get("rank") != ref.rank:
        raise _fail(where, f"it belongs to save {doc.get('save_id')!r:.40} rank {doc.get('rank')!r:.20}, not "
                           f"{index.save_id!r} rank {ref.rank}")
    algo = doc.get("checksum")
    if algo not in (CHECKSUM_ALGO, LEGACY_CHECKSUM):
        raise _fail(where, f"unknown checksum {algo!r:.40}")
    raw = doc.get("chunks")
    if not isinstance(raw, list) or len(raw) != ref.chunks:
        raise _fail(where, f"holds {len(raw) if isinstance(raw, list) else 'no list of'} chunks, the manifest "
                           f"says {ref.chunks}")
    files = _TableFiles(index, ref.rank)
    out = []
    tensors = index.tensors
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and 0 <= item[0] < len(tensors)):
            raise _fail(where, f"a chunk must be [tensor index, record] naming one of the {len(tensors)} "
                               f"tensors, got {item!r:.80}")
        if keep is not None and item[0] not in keep:
            continue
        t = tensors[item[0]]
        if (t.layout is None and t.boxes is None) or t.held_whole:
            raise _fail(where, f"tensor {t.key!r}: a chunk of a tensor every rank held whole (the index lists "
                               "those)")
        rec = _chunk_fast(item[1], len(t.shape), files, t.itemsize, algo)
        if rec is None:
            rec = _decode_chunk(item[1], f"{where} tensor {t.key!r}", len(t.shape), files, t.itemsize, codecs, algo)
        if rec.delta is not None:
            raise _fail(where, f"tensor {t.key!r}: the chunk at {list(rec.offsets)} is a delta (a table lists "
                               "none)")
        out.append((item[0], rec))
    return out


class _TableFiles(Mapping[str, int]):
    """The files a chunk of rank ``rank``'s table may lie in, with their sizes from the index: that rank's data
    file, and in version 6 its file of chunks copied from another checkpoint and the other checkpoints' files the
    index lists (``../<sibling>/...``, §4.2). A view: the index's files are not copied per table."""

    def __init__(self, index: Manifest, rank: int) -> None:
        self.files = index.files
        self.own = {data_file_name(index.save_id, rank)}
        if index.version >= 6:
            self.own.add(copies_file_name(index.save_id, rank))
        self.references = index.version >= 6

    def __getitem__(self, name: str) -> int:
        if name in self.own or (self.references and name.startswith("../")):
            return self.files[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (f for f in self.files if f in self.own or (self.references and f.startswith("../")))

    def __len__(self) -> int:
        return sum(1 for _ in self)
