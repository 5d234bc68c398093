"""Whole hash blocks of one stored chunk, back as verified raw bytes: read, decode, undo a delta, verify.

The one place that knows every way a chunk can be stored (raw, encoded frames, XOR delta against an earlier
checkpoint's chunk). Used where a few blocks are needed outside the pipelined reader: ``verify``, the delta base a
writer XORs against, and a delta chunk's base during a load.
"""

from __future__ import annotations

import numpy as np

from liferaft.codecs.checksum import verify_blocks
from liferaft.codecs.frames import decode_frames
from liferaft.errors import CorruptCheckpointError
from liferaft.format.manifest import ChunkRecord
from liferaft.storage.base import Storage

#: reads longer than this check the file's size first (a manifest's claim is never allocated before it holds)
_CHECK_SIZE_ABOVE = 64 << 20


def decode_stored(stored: memoryview, rec: ChunkRecord, first: int, end: int, dtype: str, where: str) -> memoryview:
    """The raw bytes of blocks ``[first, end)`` of ``rec`` from their stored bytes (not yet XORed, not verified)."""
    if rec.codec is None:
        return stored
    assert rec.frames is not None
    out = bytearray(min(end * rec.block_size, rec.length) - first * rec.block_size)
    decode_frames(stored, rec.frames[first:end], rec.codec, memoryview(out), rec.block_size, dtype, where)
    return memoryview(out)


def xor_into(data: memoryview, base: memoryview) -> None:
    """``data ^= base`` bytewise (same length)."""
    a = np.frombuffer(data, dtype=np.uint8)
    np.bitwise_xor(a, np.frombuffer(base, dtype=np.uint8), out=a)


def read_blocks(storage: Storage, rec: ChunkRecord, first: int, end: int, dtype: str, key: str) -> memoryview:
    """Verified raw bytes of hash blocks ``[first, end)`` of chunk ``rec`` of tensor ``key`` (``storage`` must
    resolve the record's file, e.g. ``storage.refs.with_references``). Raises CorruptCheckpointError naming the
    file and key on a missing file, short read, bad frame or checksum mismatch."""
    offset, length = rec.frame_span(first, end)
    where = f"file {rec.file!r} (key {key!r}, chunk at {list(rec.offsets)}, blocks {first}..{end})"
    if length > _CHECK_SIZE_ABOVE:          # the manifest's claim, checked against the file before allocating
        try:
            size = storage.size(rec.file)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.url}: data file {rec.file!r} is missing") from None
        if offset + length > size:
            raise CorruptCheckpointError(f"{where}: the file is truncated ({size} bytes, the chunk's blocks end at "
                                         f"{offset + length})")
    buf = bytearray(length)
    try:
        n = storage.read_into(rec.file, offset, memoryview(buf))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url}: data file {rec.file!r} is missing") from None
    if n != length:
        raise CorruptCheckpointError(f"{where}: the file is truncated (read {n} of {length} bytes)")
    raw = decode_stored(memoryview(buf), rec, first, end, dtype, where)
    if rec.delta is not None:
        raw = memoryview(bytearray(raw))
        xor_into(raw, read_blocks(storage, rec.delta, first, end, dtype, key))
    verify_blocks(raw, rec.hashes[first:end], rec.block_size, where, rec.checksum)
    return raw
