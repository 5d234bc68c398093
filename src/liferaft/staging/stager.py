"""Snapshot this rank's chunks into a buffer pool, piece by piece, for a background writer.

A piece is a byte range of one chunk's row-major bytes, at most ``piece_limit`` bytes (contiguous tensors are
cut anywhere; non-contiguous ones at row boundaries). Pieces go to the writer in order through a ``PieceQueue``;
the writer gives their pool regions back, so a budget smaller than the state is taken in waves. Small pieces
travel in batches (up to ``BATCH`` pieces, a piece of ``BATCH_END`` bytes or more ends one): one hand-off per
batch instead of per piece (a state of 20k small tensors spent more time handing pieces over than copying them).
A batch is sent before the stager waits for room, so the writer always holds every piece staged before the
wait. On CUDA the copies
run on one side stream (after the current stream's pending work) into pinned memory, each piece carrying an
event the writer waits on; there is no per-tensor synchronization of the caller's stream.
"""

from __future__ import annotations

import ctypes
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from liferaft.planning.geometry import Box
from liferaft.planning.save_plan import PAGE_ALIGN_MIN, PAGE_PHASE, WriteItem
from liferaft.staging.pool import ALIGN, PAGE, BufferPool

#: The pieces of chunks this large lie in the pool where their ranges lie in a page of the file (a chunk starts
#: ``PAGE_PHASE`` into a page: ``save_plan.place``), so that the writer sends their whole pages with O_DIRECT. The
#: two must be one number: a piece placed on a page whose chunk is not went through the page cache
#: (``PosixStorage``'s O_DIRECT needs the memory and the file range at the same place in a page).
DIRECT_MIN = PAGE_ALIGN_MIN
PIECE_LIMIT = 64 << 20      # largest piece: bounds the latency from copy to write
BATCH = 256                 # most pieces handed over at once
BATCH_END = 64 << 10        # a piece this large ends its batch (the writer starts on it at once)


def streamed_piece_limit(capacity: int) -> int:
    """The largest piece when a save streams through a pool of ``capacity`` bytes: a quarter of it (so that the
    stager copies while the writer writes), at least 1 MiB, at most ``PIECE_LIMIT``, and a whole number of pages
    (a large piece starts on a page: a size that is not a multiple of one would leave a gap after every piece,
    and a chunk as large as the pool could then never be held whole, as an incremental save must to reference it)."""
    return max(1 << 20, min(PIECE_LIMIT, capacity // 4 // PAGE * PAGE))


@dataclass
class Piece:
    item: int                   # index into this rank's write items
    offset: int                 # byte offset within the chunk
    region: int                 # pool region start, to release after writing (-1: a view of the source, no region)
    data: torch.Tensor          # uint8 view into the pool
    event: Any = None           # CUDA event to wait for before reading ``data``


@dataclass
class StageFailed:
    error: BaseException


END = None


class PieceQueue:
    """The stager's output: ``put`` a piece, a list of pieces (a batch), END or StageFailed; ``get`` returns them
    one at a time, in order (``queue.Empty`` after ``timeout`` when none is there)."""

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._ready: deque[Any] = deque()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        if self._ready:
            return self._ready.popleft()
        item = self._q.get(timeout=timeout)
        if isinstance(item, list):
            self._ready.extend(item[1:])
            return item[0]
        return item


def _ranges(src: torch.Tensor, length: int, limit: int) -> list[tuple[int, int, tuple[Any, ...] | None]]:
    """Byte ranges [a, b) of a chunk, each at most ``limit`` bytes, with the index of ``src`` they hold when the
    source is not contiguous (then ranges follow its leading dimensions: whole rows, or parts of one row)."""
    if src.is_contiguous() or src.dim() == 0:
        return [(a, min(a + limit, length), None) for a in range(0, length, limit)]
    return list(_split(tuple(src.shape), src.element_size(), limit, (), 0))


def _split(shape: tuple[int, ...], itemsize: int, limit: int, prefix: tuple[Any, ...],
           base: int) -> Iterator[tuple[int, int, tuple[Any, ...]]]:
    row = math.prod(shape[1:]) * itemsize          # bytes per index of the leading dimension
    if row <= limit or len(shape) == 1:
        step = max(1, limit // row) if row else max(1, shape[0])
        for r in range(0, shape[0], step):
            e = min(r + step, shape[0])
            yield base + r * row, base + e * row, prefix + (slice(r, e),)
    else:
        for r in range(shape[0]):
            yield from _split(shape[1:], itemsize, limit, prefix + (r,), base + r * row)


def staged_size(items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor], piece_limit: int,
                phase: int = PAGE_PHASE) -> int:
    """Pool bytes a snapshot of ``items`` takes when staged in one go (pieces rounded up to the pool alignment,
    large ones placed as ``stage`` places them for ``phase``)."""
    total = 0
    for w in items:
        src = sources[(w.key, (w.offsets, w.sizes))]
        align = _align_of(w.length)
        for a, b, _ in _ranges(src, w.length, piece_limit):
            skip = ((phase + a) % PAGE - PAGE_PHASE) % PAGE if align == PAGE else 0
            total = -(-(total - skip) // align) * align + skip + -(-(b - a) // ALIGN) * ALIGN
    return total


def _align_of(chunk_bytes: int) -> int:
    """The pieces of a large chunk lie in the pool where their ranges lie in a page of the file (a chunk's first
    piece ``PAGE_PHASE`` bytes into a page, as ``save_plan.place`` puts the chunk), so that the writer can hand
    them to O_DIRECT; a smaller chunk's piece follows the one before it at the next multiple of ``ALIGN``, as it
    does in the file, so that consecutive ones join into one request (``core.chunks.behind``)."""
    return PAGE if chunk_bytes >= DIRECT_MIN else ALIGN


def stage(items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor], pool: BufferPool,
          out: PieceQueue, piece_limit: int, timeout: float | None = None,
          in_place: Callable[[int, torch.Tensor], bool] | None = None, phase: int = PAGE_PHASE,
          one_thread: bool = False) -> float:
    """Copy every item into the pool and queue its pieces (then END); return the seconds spent copying.

    Blocks while the pool is full (the writer frees it), after handing over every piece staged before. On error,
    queues StageFailed and re-raises. ``in_place(index, source)``: whether an item's pieces are views of its source
    instead of copies (``region`` -1, no pool memory: a synchronous save, whose sources do not change until it
    returns, writes a contiguous host tensor straight from its memory — O_DIRECT from there where its pages allow).
    ``phase``: where in a page large pieces lie in the pool, as their chunks' ranges do in the file
    (``save_plan.place``: ``PAGE_PHASE``, or 0 with an alignment above it).
    ``one_thread``: copy contiguous host bytes with one ``memmove`` on this thread (the GIL released) instead of
    torch's ``copy_``, whose parallel copy starts OpenMP threads that spin once it ends: a stager that runs beside
    other work (overlapped staging beside training, a synchronous save's stager beside its writer) then takes one
    core, not all of them.
    """
    streams: dict[torch.device, Any] = {}   # one side stream per CUDA device the sources live on
    copy_s = 0.0
    generation = pool.generation          # a reset (the writer failed) stops this snapshot at its next piece
    batch: list[Piece] = []

    def flush() -> None:
        if batch:
            out.put(batch.copy() if len(batch) > 1 else batch[0])
            batch.clear()

    try:
        for idx, w in enumerate(items):
            src = sources[(w.key, (w.offsets, w.sizes))].detach()
            stream = None                   # a host tensor is copied in place, whatever else the state holds
            if src.is_cuda:
                stream = streams.get(src.device)
                if stream is None:
                    stream = streams[src.device] = torch.cuda.Stream(device=src.device)
                    stream.wait_stream(torch.cuda.current_stream(src.device))
            if in_place is not None and in_place(idx, src):
                flat = contiguous_bytes(src)
                for a in range(0, w.length, piece_limit):
                    batch.append(Piece(item=idx, offset=a, region=-1, data=flat[a:a + piece_limit]))
                    flush()
                continue
            align = _align_of(w.length)
            for a, b, rows in _ranges(src, w.length, min(piece_limit, pool.capacity)):
                at = (phase + a) % PAGE     # (where this piece's file range lies in a page)
                got = pool.try_acquire(b - a, align, generation, at)
                if got is None:             # (no room now: the writer gets what is staged, then frees room)
                    flush()
                    got = pool.acquire(b - a, timeout, align, generation, at)
                region, view = got
                t0 = time.perf_counter()
                event = _copy(src, view, a, b, rows, stream, one_thread)
                copy_s += time.perf_counter() - t0
                batch.append(Piece(item=idx, offset=a, region=region, data=view, event=event))
                if len(batch) >= BATCH or b - a >= BATCH_END:
                    flush()
        flush()
        for stream in streams.values():
            stream.synchronize()
        out.put(END)
    except BaseException as e:
        out.put(StageFailed(e))
        raise
    return copy_s


def contiguous_bytes(src: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous ``src`` as a 1-D uint8 view. A tensor torch calls contiguous may still have a
    stride other than 1 on a dimension of size 1 (one element of a column: ``t[2:3, 1]``), which ``view`` refuses;
    its elements are adjacent all the same, so it is viewed with unit stride (``as_strided``, bounds-checked
    against the storage by torch)."""
    flat = src.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _copy(src: torch.Tensor, view: torch.Tensor, a: int, b: int, rows: tuple[Any, ...] | None,
          stream: Any, one_thread: bool = False) -> Any:
    if one_thread and rows is None and stream is None and src.device.type == "cpu" and view.device.type == "cpu" \
            and src.is_contiguous() and view.is_contiguous() and view.numel() == b - a:
        part = contiguous_bytes(src)[a:b]   # (a view torch checks against the storage; clamped to the tensor)
        if part.numel() == b - a:
            ctypes.memmove(view.data_ptr(), part.data_ptr(), b - a)
            return None
    if rows is None:
        part = contiguous_bytes(src)[a:b] if src.numel() else contiguous_bytes(src)
        dst = view
    else:
        part = src[rows]
        dst = view.view(src.dtype).view(part.shape)
    if stream is None:
        dst.copy_(part)
        return None
    with torch.cuda.stream(stream):
        dst.copy_(part, non_blocking=True)
        part.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
    return event
