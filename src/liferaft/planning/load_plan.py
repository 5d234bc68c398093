"""Load planning: intersect the boxes a rank wants with the chunks that were saved → byte-range reads.

Pure functions on manifest entries and boxes. A read covers whole hash blocks (so every byte read is
verified) and only the blocks that hold wanted bytes; each read carries the strided copies that move its
bytes into the destination boxes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from liferaft.format.manifest import CHECKSUM_ALGO, ChunkRecord, TensorEntry
from liferaft.planning.geometry import Box, byte_span, intersect, split_for_reading, strides

DEFAULT_MAX_READ = 32 * 1024 * 1024


@dataclass(frozen=True)
class CopySpec:
    """Copy ``sizes`` elements from the read buffer into destination ``target``.

    The source elements start at element ``src_offset`` of the buffer with element ``src_strides``; the
    destination box starts at ``dest_offsets`` inside the target's local box.
    """

    target: int
    dest_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]


@dataclass(frozen=True)
class ReadUnit:
    """Read ``length`` bytes of ``file`` at ``file_offset`` (the stored bytes of whole hash blocks of one chunk),
    decode them when ``codec`` is set (``frames``: the stored length of each block; ``raw_length`` bytes come
    out), verify, copy."""

    key: str
    file: str
    file_offset: int
    length: int
    block_size: int
    hashes: tuple[str, ...]
    copies: tuple[CopySpec, ...]
    codec: str | None = None
    frames: tuple[int, ...] | None = None
    raw_length: int = -1
    first_block: int = 0
    delta: ChunkRecord | None = None        # XOR the decoded bytes with these blocks of this chunk (see manifest)
    checksum: str = CHECKSUM_ALGO           # the algorithm of ``hashes`` (the chunk record's)

    @property
    def decoded_length(self) -> int:
        return self.length if self.raw_length < 0 else self.raw_length


def _whole_chunk(key: str, chunk: ChunkRecord, itemsize: int, target: int, max_read: int) -> ReadUnit | None:
    """The one read of a chunk wanted whole by one target (a load into the layout it was saved in: the common
    case), as the general path below plans it, without its geometry; None when the chunk is empty or must be
    read in parts."""
    bs = chunk.block_size
    n = 1
    for d in chunk.sizes:
        n *= d
    hi = n * itemsize
    if n == 0 or hi > max(max_read - 2 * bs, bs):
        return None
    b_hi = -(-hi // bs)
    end = min(b_hi * bs, chunk.length)
    copy = CopySpec(target=target, dest_offsets=(0,) * len(chunk.sizes), sizes=tuple(chunk.sizes), src_offset=0,
                    src_strides=strides(chunk.sizes))
    file_offset, length = chunk.frame_span(0, b_hi)
    return ReadUnit(key=key, file=chunk.file, file_offset=file_offset, length=length, block_size=bs,
                    hashes=chunk.hashes[:b_hi], copies=(copy,), codec=chunk.codec,
                    frames=None if chunk.frames is None else chunk.frames[:b_hi],
                    raw_length=-1 if chunk.codec is None else end, first_block=0, delta=chunk.delta,
                    checksum=chunk.checksum)


def _units_for_chunk(key: str, chunk: ChunkRecord, itemsize: int, wanted: Sequence[tuple[int, Box]],
                     max_read: int) -> list[ReadUnit]:
    if len(wanted) == 1 and tuple(wanted[0][1][0]) == tuple(chunk.offsets) and \
            tuple(wanted[0][1][1]) == tuple(chunk.sizes):
        unit = _whole_chunk(key, chunk, itemsize, wanted[0][0], max_read)
        if unit is not None:
            return [unit]
    return _units_general(key, chunk, itemsize, wanted, max_read)


def _clip(box: Box, sizes: Sequence[int], itemsize: int, lo: int, hi: int) -> list[Box]:
    """The sub-boxes of ``box`` (chunk-local, the chunk of ``sizes``) holding exactly its elements whose bytes lie
    in ``[lo, hi)`` of the chunk's row-major bytes (``lo``, ``hi`` multiples of ``itemsize``), in row-major order:
    its whole rows there as one box, a row the bounds cut through as boxes of that row (recursively)."""
    if not sizes:                               # (a 0-dim chunk: its one element starts at byte 0)
        return [box] if lo <= 0 < hi else []
    (o0, *orest), (n0, *nrest) = box
    if not sizes[1:]:
        a, b = max(o0, lo // itemsize), min(o0 + n0, hi // itemsize)
        return [((a,), (b - a,))] if a < b else []
    row = itemsize
    for d in sizes[1:]:
        row *= d
    first, last = max(o0, lo // row), min(o0 + n0, -(-hi // row))     # the rows that reach into [lo, hi)
    out: list[Box] = []
    r = first
    while r < last:
        if r * row >= lo and (r + 1) * row <= hi:                       # whole rows: as many as lie inside
            end = min(last, hi // row)
            out.append(((r, *orest), (end - r, *nrest)))
            r = end
            continue
        for sub_o, sub_n in _clip((tuple(orest), tuple(nrest)), sizes[1:], itemsize, max(0, lo - r * row),
                                  min(row, hi - r * row)):
            out.append(((r, *sub_o), (1, *sub_n)))
        r += 1
    return out


def _grid_pieces(local: Box, sizes: Sequence[int], itemsize: int, bs: int, max_read: int) -> list[Box]:
    """``local`` (a box of a chunk of ``sizes``) cut on the chunk's hash-block grid: into windows of
    ``max(1, max_read // bs)`` whole blocks, each window's part split further where it has holes of a block or
    more (``split_for_reading``). A piece cut anywhere else is read as whole blocks, the ones it starts and ends
    in shared with its neighbours, which then read them again (pieces of a block or two — 4 MiB blocks, 8 MiB
    reads — read every block twice); a window's pieces share blocks only with each other, and are read
    together (``_units_general``). A wanted range that a window's edge cuts through takes two reads where it
    would fit one (the same bytes)."""
    window = max(1, max_read // bs) * bs
    out: list[Box] = []
    # (first the runs without holes of a block: a narrow column of wide rows spans many windows it has no byte
    # in, and visiting each made planning take seconds)
    for run in split_for_reading(local, sizes, itemsize, bs, 1 << 62):
        lo, hi = byte_span(run, sizes, itemsize)
        for w in range(lo // window * window, hi, window):
            for part in _clip(run, sizes, itemsize, w, w + window):
                out.extend(split_for_reading(part, sizes, itemsize, bs, window))
    return out


def _units_general(key: str, chunk: ChunkRecord, itemsize: int, wanted: Sequence[tuple[int, Box]],
                   max_read: int) -> list[ReadUnit]:
    bs = chunk.block_size
    cstr = strides(chunk.sizes)
    pieces: list[tuple[int, int, int, Box, Box]] = []   # (block_lo, block_hi, target, piece_local_box, dest_box)
    for target, dest in wanted:
        inter = intersect((chunk.offsets, chunk.sizes), dest)
        if inter is None:
            continue
        local = (tuple(o - c for o, c in zip(inter[0], chunk.offsets)), inter[1])
        for piece in _grid_pieces(local, chunk.sizes, itemsize, bs, max_read):
            lo, hi = byte_span(piece, chunk.sizes, itemsize)
            glob = tuple(p + c for p, c in zip(piece[0], chunk.offsets))
            dest_off = tuple(g - d for g, d in zip(glob, dest[0]))
            pieces.append((lo // bs, -(-hi // bs), target, piece, (dest_off, piece[1])))
    pieces.sort(key=lambda p: (p[0], p[1]))
    units: list[ReadUnit] = []
    group: list[tuple[int, int, int, Box, Box]] = []

    def flush() -> None:
        if not group:
            return
        b_lo = group[0][0]
        b_hi = max(p[1] for p in group)
        start = b_lo * bs
        end = min(b_hi * bs, chunk.length)
        copies = []
        for _, _, target, piece, dbox in group:
            first_elem = sum(o * s for o, s in zip(piece[0], cstr))
            copies.append(CopySpec(target=target, dest_offsets=dbox[0], sizes=piece[1],
                                   src_offset=first_elem - start // itemsize, src_strides=cstr))
        file_offset, length = chunk.frame_span(b_lo, b_hi)
        units.append(ReadUnit(key=key, file=chunk.file, file_offset=file_offset, length=length,
                              block_size=bs, hashes=chunk.hashes[b_lo:b_hi], copies=tuple(copies),
                              codec=chunk.codec, frames=None if chunk.frames is None else chunk.frames[b_lo:b_hi],
                              raw_length=-1 if chunk.codec is None else end - start, first_block=b_lo,
                              delta=chunk.delta, checksum=chunk.checksum))
        group.clear()

    per = max(1, max_read // bs)            # blocks of a window (``_grid_pieces``): a read holds one window
    for p in pieces:
        if group:
            g_lo = group[0][0]
            g_hi = max(q[1] for q in group)
            if p[0] > g_hi or (max(g_hi, p[1]) - g_lo) * bs > max_read or p[0] // per != g_lo // per:
                flush()
        group.append(p)
    flush()
    return units


def plan_reads(entry: TensorEntry, wanted: Sequence[tuple[int, Box]], max_read: int = DEFAULT_MAX_READ) -> list[ReadUnit]:
    """Reads that fill the ``wanted`` boxes (``(target index, global box)``) of tensor ``entry``.

    ``max_read`` bounds the bytes of one read (the scratch buffer a reader needs), except that a read always
    holds at least one whole hash block.
    """
    units: list[ReadUnit] = []
    for chunk in _candidates(entry, wanted):
        units.extend(_units_for_chunk(entry.key, chunk, entry.itemsize, wanted, max(max_read, chunk.block_size)))
    return units


#: from this many chunks on, the chunks a load may need are found by an array query over their bounds (one pass
#: in C per wanted box) rather than by intersecting each chunk in Python: a tensor sharded over thousands of ranks
#: has thousands of chunks, of which a rank's box overlaps a few
INDEX_FROM = 32


def _candidates(entry: TensorEntry, wanted: Sequence[tuple[int, Box]]) -> Sequence[ChunkRecord]:
    """The chunks of ``entry`` that share an element with some wanted box (a superset of those; manifest order)."""
    if len(entry.chunks) < INDEX_FROM:
        return entry.chunks
    first, end = entry.chunk_bounds
    hit = np.zeros(len(entry.chunks), dtype=bool)
    for _, (offsets, sizes) in wanted:
        lo = np.asarray(offsets, dtype=np.int64)
        hit |= np.all((first < lo + np.asarray(sizes, dtype=np.int64)) & (end > lo), axis=1)
    return [entry.chunks[i] for i in np.flatnonzero(hit)]
