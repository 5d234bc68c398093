"""Snapshot this rank's chunks into a buffer pool, piece by piece, for a background writer.

A piece is a byte range of one chunk's row-major bytes, at most ``piece_limit`` bytes (contiguous tensors are
cut anywhere; non-contiguous ones at row boundaries). Pieces go to the writer in order through a queue; the
writer gives their pool regions back, so a budget smaller than the state is taken in waves. On CUDA the copies
run on one side stream (after the current stream's pending work) into pinned memory, each piece carrying an
event the writer waits on; there is no per-tensor synchronization of the caller's stream.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from liferaft.planning.geometry import Box
from liferaft.planning.save_plan import WriteItem
from liferaft.staging.pool import ALIGN, PAGE, BufferPool

DIRECT_MIN = 64 << 10


@dataclass
class Piece:
    item: int                   # index into this rank's write items
    offset: int                 # byte offset within the chunk
    region: int                 # pool region start, to release after writing
    data: torch.Tensor          # uint8 view into the pool
    event: Any = None           # CUDA event to wait for before reading ``data``


@dataclass
class StageFailed:
    error: BaseException


END = None


def _ranges(src: torch.Tensor, length: int, limit: int) -> list[tuple[int, int, slice | None]]:
    """Byte ranges [a, b) of a chunk; with a row slice when the source must be copied by rows."""
    if src.is_contiguous() or src.dim() == 0:
        return [(a, min(a + limit, length), None) for a in range(0, length, limit)]
    row = length // src.shape[0]
    rows = max(1, limit // row)
    return [(r * row, min(r + rows, src.shape[0]) * row, slice(r, min(r + rows, src.shape[0])))
            for r in range(0, src.shape[0], rows)]


def staged_size(items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor], piece_limit: int) -> int:
    """Pool bytes a snapshot of ``items`` takes when staged in one go (pieces rounded up to the pool alignment)."""
    total = 0
    for w in items:
        src = sources[(w.key, (w.offsets, w.sizes))]
        for a, b, _ in _ranges(src, w.length, piece_limit):
            total = -(-total // _align_of(b - a)) * _align_of(b - a) + -(-(b - a) // ALIGN) * ALIGN
    return total


def _align_of(nbytes: int) -> int:
    """Large pieces start on a page, so that the writer can hand them to O_DIRECT."""
    return PAGE if nbytes >= DIRECT_MIN else ALIGN


def stage(items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor], pool: BufferPool,
          out: "queue.Queue[Any]", piece_limit: int, timeout: float | None = None) -> float:
    """Copy every item into the pool and queue its pieces (then END); return the seconds spent copying.

    Blocks while the pool is full (the writer frees it). On error, queues StageFailed and re-raises.
    """
    stream = None
    copy_s = 0.0
    try:
        for idx, w in enumerate(items):
            src = sources[(w.key, (w.offsets, w.sizes))].detach()
            if src.is_cuda and stream is None:
                stream = torch.cuda.Stream(device=src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
            for a, b, rows in _ranges(src, w.length, min(piece_limit, pool.capacity)):
                region, view = pool.acquire(b - a, timeout, _align_of(b - a))
                t0 = time.perf_counter()
                event = _copy(src, view, a, b, rows, stream)
                copy_s += time.perf_counter() - t0
                out.put(Piece(item=idx, offset=a, region=region, data=view, event=event))
        if stream is not None:
            stream.synchronize()
        out.put(END)
    except BaseException as e:  # noqa: BLE001 - the writer must learn about it, then the caller
        out.put(StageFailed(e))
        raise
    return copy_s


def _copy(src: torch.Tensor, view: torch.Tensor, a: int, b: int, rows: slice | None, stream: Any) -> Any:
    if rows is None:
        part = src.reshape(-1).view(torch.uint8)[a:b] if src.numel() else src.reshape(-1).view(torch.uint8)
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
