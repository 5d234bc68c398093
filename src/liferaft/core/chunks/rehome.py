"""Copy referenced chunks into the checkpoint being saved, so that it stops depending on where they were.

An incremental save references the chunks that did not change (``writer``); when the chunks taken from some older
checkpoint are only crumbs of the save (``planning.references.crumb_sources``, decided alike on every rank), each
rank copies its own such chunks — their stored bytes as they are, verified on the way — into one extra data file
of the new checkpoint, ``data/<save id>/r<rank>-copies.bin``, and reports the records with their new place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from liferaft.codecs.checksum import verify_blocks
from liferaft.core.chunks.blocks import decode_stored, read_blocks, xor_into
from liferaft.core.chunks.writer import StoredChunk
from liferaft.errors import StorageError
from liferaft.format.layout import copies_file_name
from liferaft.planning.references import sibling_of
from liferaft.planning.save_plan import WriteItem
from liferaft.storage.base import FileWriter, Storage
from liferaft.storage.refs import with_references


def copy_references(storage: Storage, save_id: str, rank: int, writes: Sequence[WriteItem],
                    chunks: Sequence[StoredChunk], sources: frozenset[str], dtypes: Mapping[str, str],
                    alignment: int) -> tuple[list[StoredChunk], int, int]:
    """``chunks`` (this rank's stored chunks of ``writes``) with every chunk whose bytes live in one of the sibling
    checkpoints ``sources`` copied into this rank's copies file; also (bytes copied, raw bytes of those chunks).

    The copied bytes are verified against the chunk's hashes first (a damaged base fails the save, naming the
    file, instead of being copied). On error the partial file is removed."""
    moving = [i for i, sc in enumerate(chunks) if sibling_of(sc.file) in sources]
    if not moving:
        return list(chunks), 0, 0
    reader = with_references(storage)
    name = copies_file_name(save_id, rank)
    out = list(chunks)
    end = copied = raw = 0
    f: FileWriter | None = None
    try:
        f = storage.open_writer(name)
        for i in moving:
            w, sc = writes[i], chunks[i]
            data = _verified_stored(reader, w, sc, dtypes[w.key])
            pos = -(-end // alignment) * alignment
            f.pwrite(data, pos)
            end = pos + len(data)
            copied += len(data)
            raw += w.length
            out[i] = replace(sc, file=name, byte_offset=pos, origin=sc.origin or sibling_of(sc.file),
                             ref_files={k: v for k, v in (sc.ref_files or {}).items()
                                        if sc.delta is not None and k == sc.delta.file})
        f.close()
    except BaseException as e:
        if f is not None:
            f.abort()
        if isinstance(e, OSError):
            raise StorageError(f"{storage.url}: copying referenced chunks into {name!r} failed: {e}") from e
        raise
    for i in moving:
        out[i].ref_files[name] = end            # type: ignore[index]  (set just above)
    return out, copied, raw


def _verified_stored(reader: Storage, w: WriteItem, sc: StoredChunk, dtype: str) -> bytearray:
    """The stored bytes of chunk ``sc`` (raw or encoded frames, as in its file), checked against its hashes."""
    from liferaft.errors import CorruptCheckpointError
    from liferaft.format.manifest import ChunkRecord

    rec = ChunkRecord(offsets=w.offsets, sizes=w.sizes, file=sc.file, byte_offset=sc.byte_offset, length=w.length,
                      block_size=sc.block_size, hashes=tuple(sc.hashes), codec=sc.codec, frames=sc.frames,
                      delta=sc.delta, checksum=sc.checksum)
    buf = bytearray(rec.stored_length)
    where = f"file {rec.file!r} (key {w.key!r}, chunk at {list(rec.offsets)})"
    try:
        n = reader.read_into(rec.file, rec.byte_offset, memoryview(buf))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{reader.url}: data file {rec.file!r} is missing") from None
    if n != len(buf):
        raise CorruptCheckpointError(f"{where}: the file is truncated (read {n} of {len(buf)} bytes)")
    blocks = len(rec.hashes)
    plain = decode_stored(memoryview(buf), rec, 0, blocks, dtype, where)
    if rec.delta is not None:
        plain = memoryview(bytearray(plain))
        xor_into(plain, read_blocks(reader, rec.delta, 0, blocks, dtype, w.key))
    verify_blocks(plain, rec.hashes, rec.block_size, where, rec.checksum)
    return buf


__all__ = ["copies_file_name", "copy_references"]
