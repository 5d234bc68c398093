"""Block checksums: a chunk's stored bytes hashed in fixed-size blocks, by the algorithm its record names.

Blocks let a resharding load verify exactly the bytes it reads without reading whole chunks. Two algorithms
(``format.records.CHECKSUM_ALGOS``; docs/FORMAT.md §3.1), digests as lower-case hex:

- ``crc32c`` (what saves write): CRC-32C (Castagnoli) from the ``crc32c`` package, hardware-computed (SSE4.2 /
  ARMv8 CRC; a software table elsewhere) and computed **without the GIL** for blocks of 32 KiB and more (every
  block but a chunk's short tail): a background save hashing 1 GB does not stall a Python training loop.
- ``xxh3_64`` (checkpoints written before ``crc32c``, the commit marker's pin of the manifest, the per-step
  log's records): XXH3-64 from python-xxhash, which releases the GIL while it hashes (since python-xxhash 3.0,
  the oldest this package accepts).

Every function takes the algorithm by name; an unknown name raises CorruptCheckpointError (the manifest decoder
refuses one first, so a reader never gets here with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import crc32c
import xxhash

from liferaft.errors import CorruptCheckpointError
from liferaft.format.records import CHECKSUM_ALGO, CHUNK_DIGEST, LEGACY_CHECKSUM

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


def _crc32c_hex(data: bytes | memoryview) -> str:
    return f"{crc32c.crc32c(data):08x}"


_DIGESTS: dict[str, Callable[[bytes | memoryview], str]] = {
    "crc32c": _crc32c_hex,
    "xxh3_64": xxhash.xxh3_64_hexdigest,
}


#: bits of each algorithm's digest: an equality decision rests on at least 64 (``ChunkRecord.digest`` otherwise)
CHECKSUM_BITS: dict[str, int] = {"crc32c": 32, "xxh3_64": 64}


def _digest_fn(algo: str) -> Callable[[bytes | memoryview], str]:
    fn = _DIGESTS.get(algo)
    if fn is None:
        raise CorruptCheckpointError(f"block checksum algorithm {algo!r:.40} is unknown to this liferaft (known: "
                                     f"{', '.join(_DIGESTS)}); the checkpoint was written by a newer liferaft: "
                                     "upgrade liferaft to read it")
    return fn


def digest(data: bytes | memoryview, algo: str = LEGACY_CHECKSUM) -> str:
    """Hex digest of ``data`` by ``algo`` (default xxh3_64: 64 bits, for whole-object pins and equality tests
    such as the commit marker's manifest hash, where the GIL does not matter)."""
    return _digest_fn(algo)(data)


def block_hashes(data: memoryview, block_size: int, algo: str = CHECKSUM_ALGO) -> list[str]:
    """``algo`` hex digest of each ``block_size`` slice of ``data`` (the last may be shorter)."""
    fn = _digest_fn(algo)
    return [fn(data[i:i + block_size]) for i in range(0, len(data), block_size)]


def verify_blocks(data: memoryview, hashes: Sequence[str], block_size: int, where: str, algo: str,
                  first: int = 0) -> None:
    """Raise CorruptCheckpointError naming ``where`` if any block of ``data`` does not match its ``algo`` hash in
    ``hashes`` (``algo``: the algorithm the chunk's record names). ``first``: the number of ``data``'s first
    block in the read it comes from (for the message only: ``data`` starts at byte ``first * block_size``)."""
    fn = _digest_fn(algo)
    n = len(data)
    base = first * block_size
    for i, expected in enumerate(hashes):
        lo = i * block_size
        if lo >= n:
            raise CorruptCheckpointError(f"{where}: read {base + n} bytes but {first + len(hashes)} blocks were "
                                         "expected; the file is truncated. Restore from another checkpoint or copy")
        if fn(data[lo:lo + block_size]) != expected:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in block {first + i} (bytes {base + lo}..{base + min(lo + block_size, n)}"
                f" of this read, {algo}); the stored data is corrupt. Restore from another checkpoint or copy")


class _Crc32cStream:
    """CRC-32C over pieces fed in order (the ``xxhash.xxh3_64`` object's interface, the part used here)."""

    def __init__(self) -> None:
        self._v = 0

    def update(self, data: memoryview) -> None:
        self._v = crc32c.crc32c(data, self._v)

    def hexdigest(self) -> str:
        return f"{self._v:08x}"

    def reset(self) -> None:
        self._v = 0


_STREAMS: dict[str, Callable[[], _Crc32cStream | xxhash.xxh3_64]] = {"crc32c": _Crc32cStream, "xxh3_64": xxhash.xxh3_64}


def stream(algo: str) -> _Crc32cStream | xxhash.xxh3_64:
    """A streaming hasher of ``algo``: ``update`` with pieces in order, then ``hexdigest`` equals :func:`digest` of
    their concatenation (CorruptCheckpointError for an unknown ``algo``)."""
    _digest_fn(algo)
    return _STREAMS[algo]()


def chunk_digest(data: bytes | memoryview) -> str:
    """The ``CHUNK_DIGEST`` hex digest of a whole chunk's raw bytes (``ChunkRecord.digest``)."""
    return digest(data, CHUNK_DIGEST)


class BlockHasher:
    """Streaming block hashes: feed a chunk's bytes in pieces of any size, in order; same result as
    :func:`block_hashes` over the whole chunk with the same ``algo``. With ``whole``, also the
    :func:`chunk_digest` of all the bytes fed (:meth:`digest`), in the same pass."""

    def __init__(self, block_size: int, algo: str = CHECKSUM_ALGO, whole: bool = False) -> None:
        _digest_fn(algo)
        self.block_size = block_size
        self.algo = algo
        self._h = _STREAMS[algo]()
        self._filled = 0
        self._out: list[str] = []
        self._whole = xxhash.xxh3_64() if whole else None

    def digest(self) -> str | None:
        """:func:`chunk_digest` of every byte fed so far (None without ``whole``)."""
        return None if self._whole is None else self._whole.hexdigest()

    def update(self, data: memoryview) -> None:
        """Feed the next ``data``. With ``whole``, each block goes to the chunk digest right after its CRC: the
        block is still in the CPU cache (one pass over memory, not two). Both hashes run without the GIL (the
        module doc; measured with python-xxhash 4.1: a thread hashing 1 GiB left another thread's loop its full
        rate)."""
        pos, n = 0, len(data)
        bs, dg = self.block_size, self._whole
        if self._filled == 0:                      # whole blocks straight from the piece
            whole = (n // bs) * bs
            if dg is None:
                self._out.extend(block_hashes(data[:whole], bs, self.algo) if whole else [])
            else:
                fn, out, feed = _digest_fn(self.algo), self._out, dg.update
                for i in range(0, whole, bs):
                    block = data[i:i + bs]
                    out.append(fn(block))
                    feed(block)
            pos = whole
        while pos < n:
            take = min(bs - self._filled, n - pos)
            if dg is not None:
                dg.update(data[pos:pos + take])
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
