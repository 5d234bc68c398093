"""The chunk codec contract: one hash block of a chunk ↔ one stored frame (docs/FORMAT.md §4.1).

An encoded chunk stores each hash block as one independent frame, back to back, with the stored length of each
in ``ChunkRecord.frames`` and the codec's ``name`` in ``ChunkRecord.codec``. A codec is a stateless object:

- ``name``: what the manifest stores. A name denotes one frame layout forever; a new layout is a new name.
- what it applies to: ``dtypes`` (manifest dtype names; None: any) and ``lossless`` (False: the decoded values
  differ from the saved ones by at most ``error_bound``; lossy codecs are opt-in only and recorded in the
  manifest's ``lossy`` entry, with ``params``).
- ``encode_block`` / ``decode_block``: one raw block (whole elements of ``dtype``) ↔ one frame. Every block is
  its own frame, so a partial decode of blocks ``[first, end)`` is the decode of ``frames[first:end]`` alone
  (``codecs.frames.decode_frames``); nothing carries over from one block to the next.
- ``encode_chunk``: the frames of a whole chunk's blocks on a worker pool, with what the writer records for a
  lossy codec (the hashes of the decoded blocks, the error); a codec may override it to share work between the
  blocks of a chunk (``bytegroup-zstd`` skips byte planes its first block showed to be random).
- bounds: ``max_expansion``, the most raw bytes per stored byte; ``decode_block`` checks a frame's header
  against ``out`` before allocating anything for it (a frame never declares more than its block).
- damage: ``decode_block`` raises CorruptCheckpointError naming ``where`` for any frame whose structure does not
  hold (magic, version, lengths, entropy-coded payloads) and never another exception, whatever the bytes. Damage
  that leaves a frame well formed is caught by the block hashes, which are always those of the decoded bytes
  and which every reader verifies after decoding; so a damaged frame never yields a silently wrong value.

Codecs are looked up by name in ``codecs.registry``; ``tests/unit/test_codec_conformance.py`` runs the contract's
checks (round trip within the bound, damage detected, partial decode, empty and odd-sized blocks) on every
registered codec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar


class CannotEncode(ValueError):
    """A codec cannot represent these values (e.g. a non-finite value for a quantizer): the writer stores the
    chunk raw instead. Internal to the write path, never raised to a caller."""


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk's frames, one per hash block, and what a lossy codec adds to its record."""

    frames: list[bytes]
    #: lossy: the hash (``format.records.CHECKSUM_ALGO``) of each *decoded* block (what readers verify); None: the
    #: raw blocks' hashes stand
    hashes: tuple[str, ...] | None = None
    #: lossy: (max abs error, sum of abs errors, values) against the saved values; None for lossless
    error: tuple[float, float, int] | None = None


class Codec(ABC):
    """One chunk codec (see the module docstring for the contract)."""

    #: the name stored in ``ChunkRecord.codec``
    name: ClassVar[str]
    #: True: ``decode(encode(x)) == x`` bit for bit, for every dtype it accepts
    lossless: ClassVar[bool]
    #: the manifest dtype names this codec takes; None: any
    dtypes: ClassVar[frozenset[str] | None] = None
    #: settings a lossy codec records in the manifest's ``lossy`` entry (beside ``method`` = ``name``)
    params: ClassVar[Mapping[str, Any]] = {}
    #: the most raw bytes one stored byte of a frame can decode to (a block of ``b`` bytes needs a frame of at
    #: least ``b / max_expansion`` bytes): opening a checkpoint refuses a chunk whose frames claim more, before
    #: anything is allocated for it. None: no bound (a codec registered without one).
    max_expansion: ClassVar[int | None] = None

    def accepts(self, dtype: str) -> bool:
        """Whether blocks of ``dtype`` may be given to this codec."""
        return self.dtypes is None or dtype in self.dtypes

    @abstractmethod
    def encode_block(self, block: memoryview, dtype: str) -> bytes:
        """The frame of one raw block (a whole number of ``dtype`` elements, possibly none). Raises
        CannotEncode when the values cannot be represented (the chunk is then stored raw)."""

    @abstractmethod
    def decode_block(self, frame: memoryview, out: memoryview, dtype: str, where: str) -> None:
        """Decode ``frame`` into ``out``, a writable buffer of exactly the block's raw length. Raises
        CorruptCheckpointError naming ``where`` when the frame is malformed (and no other exception)."""

    def error_bound(self, block: memoryview, dtype: str) -> float:
        """The largest absolute difference between any value of ``block`` and its decoded value: 0.0 for a
        lossless codec. (The conformance test holds every codec to it.)"""
        return 0.0

    def encode_chunk(self, blocks: Sequence[memoryview], dtype: str, pool: Executor | None,
                     pays: float | None = None) -> EncodedChunk | None:
        """The frames of a chunk's ``blocks``, encoded in parallel on ``pool`` (None: on this thread), and for a
        lossy codec the hashes of the decoded blocks and the error. None: store the chunk raw, because the codec
        cannot encode these values, or (lossless codecs) ``pays`` is given and the first block's frame is not
        smaller than ``pays`` × the block."""
        if not blocks:
            return EncodedChunk(frames=[])
        try:
            if not self.lossless:
                got = map_blocks(pool, lambda b: self._encode_checked(b, dtype), blocks)
                return EncodedChunk(frames=[r[0] for r in got], hashes=tuple(r[1] for r in got),
                                    error=(max(r[2] for r in got), sum(r[3] for r in got), sum(r[4] for r in got)))
            if pays is None:
                return EncodedChunk(frames=map_blocks(pool, lambda b: self.encode_block(b, dtype), blocks))
            first = self.encode_block(blocks[0], dtype)
            if len(first) >= pays * len(blocks[0]):
                return None
            return EncodedChunk(frames=[first] + map_blocks(pool, lambda b: self.encode_block(b, dtype), blocks[1:]))
        except CannotEncode:
            return None

    def _encode_checked(self, block: memoryview, dtype: str) -> tuple[bytes, str, float, float, int]:
        """(frame, hash of the block it decodes to (the algorithm saves record, ``CHECKSUM_ALGO``), max abs error,
        sum of abs errors, values)."""
        import torch

        from liferaft.codecs.checksum import digest
        from liferaft.format.records import CHECKSUM_ALGO

        frame = self.encode_block(block, dtype)
        out = bytearray(len(block))
        self.decode_block(memoryview(frame), memoryview(out), dtype, f"{self.name} frame just encoded")
        tdt = getattr(torch, dtype)
        if not len(block):
            return frame, digest(memoryview(out), CHECKSUM_ALGO), 0.0, 0.0, 0
        got, saved = torch.frombuffer(out, dtype=tdt), torch.frombuffer(bytearray(block), dtype=tdt)
        diff = (got.double() - saved.double()).abs()
        return frame, digest(memoryview(out), CHECKSUM_ALGO), float(diff.max()), float(diff.sum()), diff.numel()


def map_blocks(pool: Executor | None, fn: Any, items: Sequence[memoryview]) -> list[Any]:
    """``fn`` over ``items``: on ``pool`` when there are several, else (or without a pool) on this thread."""
    if pool is None or len(items) <= 1:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))
