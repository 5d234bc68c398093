"""Lossless compression for tensor bytes: byte grouping (byte planes) + zstd.

Floating-point values compress badly as they are stored (sign, exponent and mantissa bytes interleave), but well
once the k-th byte of every element is stored together: the exponent planes of trained weights are highly
repetitive, the low mantissa planes are nearly random (ZipNN, LMC). ``encode`` splits ``data`` of
``itemsize``-byte elements into ``itemsize`` planes, compresses each with zstd on its own, and stores a plane raw
when zstd would not shrink it (so random bytes cost a copy, not an expansion). Frame layout (little endian)::

    b"LRBG" | u8 version=1 | u8 itemsize | u64 length | itemsize × (u8 mode, u64 size) | plane payloads

mode 0 = raw plane, 1 = zstd frame. A tail of ``length % itemsize`` bytes is stored as one more raw plane.
Pure functions of bytes; numpy does the grouping and zstd (the ``zstandard`` package) the entropy coding, both
outside the GIL for large buffers. ``ByteGroupZstd`` is the codec ``bytegroup-zstd`` (``codecs.base``): one frame
per hash block. Each thread keeps its own zstd contexts (``_compressor``), for as long as the thread lives.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from liferaft.codecs.base import Codec, EncodedChunk, map_blocks
from liferaft.errors import CorruptCheckpointError
from liferaft.format.manifest import DTYPE_ITEMSIZE

MAGIC = b"LRBG"
_HEAD = struct.Struct("<4sBBQ")
_PLANE = struct.Struct("<BQ")
#: the most bytes ``decode`` makes without an ``out`` buffer (a frame holds one hash block: 4 MiB by default)
MAX_DECODED = 1 << 30


_LOCAL = threading.local()


def _compressor(level: int) -> Any:
    """This thread's zstd context for ``level`` (creating one per call costs more than compressing 256 KiB, and
    the allocation serializes the codec threads)."""
    import zstandard

    cache = getattr(_LOCAL, "cctx", None)
    if cache is None:
        cache = _LOCAL.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level)
    return cctx


def _decompressor() -> Any:
    import zstandard

    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode(data: memoryview | bytes, itemsize: int, level: int = 1, raw_planes: frozenset[int] = frozenset()) -> bytes:
    """The byte-grouped, zstd-compressed frame of ``data`` (elements of ``itemsize`` bytes, 1 to 8). Planes in
    ``raw_planes`` are stored raw without trying zstd (see ``incompressible``)."""
    if not 1 <= itemsize <= 8:
        raise ValueError(f"itemsize must be 1..8, got {itemsize}")
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = len(buf)
    whole = n - n % itemsize
    grid = buf[:whole].reshape(-1, itemsize) if itemsize > 1 else None
    cctx = _compressor(level)
    payloads: list[tuple[int, bytes | memoryview]] = []
    for k in range(itemsize):
        if k in raw_planes and grid is not None:
            payloads.append((0, memoryview(np.ascontiguousarray(grid[:, k])).cast("B")))
            continue
        raw = memoryview(np.ascontiguousarray(grid[:, k]) if grid is not None else buf[:whole]).cast("B")
        packed = cctx.compress(raw) if len(raw) else b""
        payloads.append((1, packed) if len(packed) < len(raw) else (0, raw))
    tail = memoryview(buf[whole:]).cast("B")
    out: list[bytes | memoryview] = [_HEAD.pack(MAGIC, 1, itemsize, n)]
    out += [_PLANE.pack(mode, len(payload)) for mode, payload in payloads]
    out.append(_PLANE.pack(0, len(tail)))
    out += [payload for _, payload in payloads]
    out.append(tail)
    return b"".join(out)


def incompressible(frame: bytes | memoryview, threshold: float = 0.97) -> frozenset[int]:
    """The planes of ``frame`` that zstd shrank to no less than ``threshold`` of their size (or not at all): for a
    chunk's later blocks, ``encode(..., raw_planes=...)`` then skips trying (low mantissa bytes of trained
    weights are close to random)."""
    mv = memoryview(frame).cast("B")
    _, _, itemsize, n = _HEAD.unpack_from(mv, 0)
    per_plane = (n - n % itemsize) // itemsize
    out = set()
    for k in range(itemsize):
        mode, size = _PLANE.unpack_from(mv, _HEAD.size + k * _PLANE.size)
        if mode == 0 or size >= threshold * per_plane:
            out.add(k)
    return frozenset(out)


def decode(blob: bytes | memoryview, out: memoryview | None = None, where: str = "chunk",
           max_size: int = MAX_DECODED) -> bytes | None:
    """Invert ``encode``: into ``out`` (a writable buffer of exactly the original length; returns None) or as new
    bytes (at most ``max_size``). Raises CorruptCheckpointError naming ``where`` on any inconsistency (and no
    other exception: the frame's lengths are checked, against ``out`` or ``max_size``, before anything is
    allocated or decoded; zstd never writes more than a plane's expected size)."""
    import zstandard

    mv = memoryview(blob).cast("B")
    try:
        magic, version, itemsize, n = _HEAD.unpack_from(mv, 0)
    except struct.error:
        raise CorruptCheckpointError(f"{where}: compressed frame too short") from None
    if magic != MAGIC or version != 1 or not 1 <= itemsize <= 8:
        raise CorruptCheckpointError(f"{where}: not a liferaft byte-group frame (magic {magic!r}, v{version})")
    pos = _HEAD.size + (itemsize + 1) * _PLANE.size
    if len(mv) < pos:
        raise CorruptCheckpointError(f"{where}: compressed frame too short")
    whole = n - n % itemsize
    per_plane = whole // itemsize
    if out is not None and len(out) != n:
        raise CorruptCheckpointError(f"{where}: the frame holds {n} bytes, the block has {len(out)}")
    if out is None and n > max_size:
        raise CorruptCheckpointError(f"{where}: the frame declares {n} bytes, more than the {max_size} expected")
    planes = []
    for k in range(itemsize + 1):
        mode, size = _PLANE.unpack_from(mv, _HEAD.size + k * _PLANE.size)
        want = per_plane if k < itemsize else n - whole
        payload = mv[pos:pos + size]
        pos += size
        if len(payload) != size:
            raise CorruptCheckpointError(f"{where}: compressed frame truncated")
        if mode == 0 and size != want or mode not in (0, 1):
            raise CorruptCheckpointError(f"{where}: plane {k} (mode {mode}, {size} bytes) does not hold the "
                                         f"{want} bytes of the frame")
        if mode == 1:
            try:
                stated = zstandard.frame_content_size(payload)
            except zstandard.ZstdError as e:
                raise CorruptCheckpointError(f"{where}: zstd plane {k} does not decode: {e}") from None
            if stated not in (-1, want):
                raise CorruptCheckpointError(f"{where}: plane {k} has {stated} bytes, expected {want}")
        planes.append((mode, payload, want))
    if pos != len(mv):
        raise CorruptCheckpointError(f"{where}: compressed frame has {len(mv) - pos} bytes after its planes")
    target = np.empty(n, dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    grid = target[:whole].reshape(-1, itemsize) if itemsize > 1 else None
    dctx = _decompressor()
    for k, (mode, payload, want) in enumerate(planes):
        try:
            plane = payload if mode == 0 else dctx.decompress(payload, max_output_size=want)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{where}: zstd plane {k} does not decode: {e}") from None
        if len(plane) != want:
            raise CorruptCheckpointError(f"{where}: plane {k} has {len(plane)} bytes, expected {want}")
        arr = np.frombuffer(plane, dtype=np.uint8)
        if k == itemsize:
            target[whole:] = arr
        elif grid is not None:
            grid[:, k] = arr
        else:
            target[:whole] = arr
    return None if out is not None else target.tobytes()


def _plane_width(dtype: str) -> int:
    """Bytes per element as the planes see it: the dtype's item size, except complex128, grouped as the two
    float64 it holds (a frame stores at most 8 planes)."""
    return min(DTYPE_ITEMSIZE[dtype], 8)


class ByteGroupZstd(Codec):
    """Codec ``bytegroup-zstd`` (lossless, any dtype): one ``encode`` frame per hash block, at zstd ``level``.

    ``encode_chunk`` with ``pays`` encodes the first block alone; when it pays, the later blocks store raw the
    planes the first one showed to be random (``incompressible``) without trying zstd on them."""

    name = "bytegroup-zstd"
    lossless = True
    #: zstd's densest block (RLE: 4 bytes for 128 KiB) is 32768:1; byte planes, headers and tails only lower it
    max_expansion = 1 << 15

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode_block(self, block: memoryview, dtype: str) -> bytes:
        return encode(block, _plane_width(dtype), self.level)

    def decode_block(self, frame: memoryview, out: memoryview, dtype: str, where: str) -> None:
        decode(frame, out, where)

    def encode_chunk(self, blocks: Sequence[memoryview], dtype: str, pool: Executor | None,
                     pays: float | None = None) -> EncodedChunk | None:
        if pays is None or not blocks:
            return super().encode_chunk(blocks, dtype, pool, pays)
        itemsize = _plane_width(dtype)
        first = encode(blocks[0], itemsize, self.level)
        if len(first) >= pays * len(blocks[0]):
            return None
        raw = incompressible(first)
        rest = map_blocks(pool, lambda b: encode(b, itemsize, self.level, raw), blocks[1:])
        return EncodedChunk(frames=[first] + rest)
