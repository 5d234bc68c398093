"""Reading one tensor of a checkpoint in slabs of leading-dimension rows (bounded memory), for the tools."""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator, TypeVar

import torch

from liferaft.core.chunks.reader import execute_reads
from liferaft.format.manifest import TensorEntry
from liferaft.planning.load_plan import plan_reads
from liferaft.state.dtypes import torch_dtype

T = TypeVar("T")


def slabs(entry: TensorEntry, slab_bytes: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of whole leading-dimension rows, about ``slab_bytes`` each, covering the tensor in order."""
    shape = entry.shape
    if not shape:
        return [((), ())]
    row = entry.itemsize
    for s in shape[1:]:
        row *= s
    rows = max(1, slab_bytes // max(row, 1))
    return [((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + tuple(shape[1:]))
            for r in range(0, shape[0], rows)] or [((0,) * len(shape), tuple(shape))]


def read_box(storage: Any, entry: TensorEntry, box: Any, max_read: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``box`` of tensor ``entry``, read and verified (into ``out``, a uint8 buffer at least that
    large, when given: reusing one buffer saves the first touch of fresh memory for every slab)."""
    dt = torch_dtype(entry.dtype)
    if out is not None:
        n = 1
        for s in box[1]:
            n *= s
        target = out[:n * torch.empty(0, dtype=dt).element_size()].view(dt).view(box[1])
    else:
        target = torch.empty(box[1], dtype=dt)
    units = [(u, target.dtype) for u in plan_reads(entry, [(0, box)], max_read)]
    execute_reads(storage, units, [target], max_read=max_read)
    return target


def prefetched(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """The items of ``items``, produced by a background thread up to ``depth`` ahead of the consumer (so the next
    slab is read while this one is written). Errors are raised to the consumer; stopping early stops the thread."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(("item", x)):
                    return
            put(("end", None))
        except BaseException as e:              # handed to the consumer
            put(("error", e))

    t = threading.Thread(target=run, name="liferaft-prefetch", daemon=True)
    t.start()
    try:
        while True:
            kind, x = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise x
            yield x
    finally:
        stop.set()
        t.join()


def slab_values(storage: Any, entry: TensorEntry, slab_bytes: int, dtype: torch.dtype | None = None,
                ring: list[torch.Tensor] | None = None, max_read: int = 32 << 20,
                base: int | None = None) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(box, values)`` for the row slabs of ``entry`` in order, read and verified; cast to ``dtype`` when given.
    With ``ring`` (uint8 buffers of at least ``slab_bytes`` + 4 KiB) slabs are read into its buffers in turn (no
    fresh memory to touch; a consumer must be done with a slab ``len(ring) - 1`` slabs later), else into new
    tensors. ``base``: the file offset the tensor's bytes will be written at; each slab then lies in its buffer
    on the same 4 KiB boundaries as in the file (so the writer can use O_DIRECT without a copy)."""
    row = entry.itemsize
    for s in entry.shape[1:]:
        row *= s
    for i, box in enumerate(slabs(entry, slab_bytes)):
        n = entry.itemsize
        for s in box[1]:
            n *= s
        shift = (base + (box[0][0] if box[0] else 0) * row) % 4096 if base is not None else 0
        if shift % entry.itemsize:              # (a view of the buffer must start on an element; the writer copies)
            shift = 0
        buf = ring[i % len(ring)] if ring and shift + n <= ring[0].numel() else None
        t = read_box(storage, entry, box, max_read, out=None if buf is None else buf[shift:])
        yield box, (t.to(dtype) if dtype is not None and dtype != t.dtype else t)
