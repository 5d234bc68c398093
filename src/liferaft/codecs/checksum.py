"""Block checksums: xxh3_64 over fixed-size blocks of a chunk's stored bytes.

Blocks let a resharding load verify exactly the bytes it reads without reading whole chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from liferaft.errors import CorruptCheckpointError

MIN_BLOCK_SIZE = 64 << 10
MAX_BLOCK_SIZE = 4 << 20
BLOCKS_PER_CHUNK = 64


def choose_block_size(length: int, fixed: int | None = None) -> int:
    """The checksum block size for a chunk of ``length`` bytes: ``fixed`` if given, else about 1/64 of the
    chunk rounded up to a power of two, within [64 KiB, 4 MiB] — fine-grained enough that a resharding load
    reads little beyond what it needs, coarse enough that the manifest stays small (<= ~256 hashes per GiB)."""
    if fixed is not None:
        return fixed
    target = max(1, length // BLOCKS_PER_CHUNK)
    return min(MAX_BLOCK_SIZE, max(MIN_BLOCK_SIZE, 1 << (target - 1).bit_length()))


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def block_hashes(data: memoryview, block_size: int) -> list[str]:
    """xxh3_64 hex digest of each ``block_size`` slice of ``data`` (the last may be shorter)."""
    n = len(data)
    return [xxhash.xxh3_64_hexdigest(data[i:i + block_size]) for i in range(0, n, block_size)]


def verify_blocks(data: memoryview, hashes: Sequence[str], block_size: int, where: str) -> None:
    """Raise CorruptCheckpointError naming ``where`` if any block of ``data`` does not match ``hashes``."""
    n = len(data)
    for i, expected in enumerate(hashes):
        lo = i * block_size
        if lo >= n:
            raise CorruptCheckpointError(f"{where}: read {n} bytes but {len(hashes)} blocks were expected")
        got = xxhash.xxh3_64_hexdigest(data[lo:lo + block_size])
        if got != expected:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in block {i} (bytes {lo}..{min(lo + block_size, n)} of this read); "
                "the stored data is corrupt. Restore from another checkpoint or copy")


class BlockHasher:
    """Streaming block hashes: feed a chunk's bytes in pieces of any size, in order; same result as
    :func:`block_hashes` over the whole chunk."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._h = xxhash.xxh3_64()
        self._filled = 0
        self._out: list[str] = []

    def update(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        if self._filled == 0:                      # whole blocks straight from the piece
            whole = (n // self.block_size) * self.block_size
            self._out.extend(block_hashes(data[:whole], self.block_size) if whole else [])
            pos = whole
        while pos < n:
            take = min(self.block_size - self._filled, n - pos)
            self._h.update(data[pos:pos + take])
            self._filled += take
            pos += take
            if self._filled == self.block_size:
                self._out.append(self._h.hexdigest())
                self._h.reset()
                self._filled = 0

    def finish(self) -> list[str]:
        if self._filled:
            self._out.append(self._h.hexdigest())
            self._h.reset()
            self._filled = 0
        return self._out
