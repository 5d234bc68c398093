"""Reading one tensor of a checkpoint of any format in slabs of leading-dimension rows (bounded memory), through the
reader protocol (``formats.base.Reader.plan``), for the tools: exports, ``diff`` and ``describe --stats``."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

from liferaft.formats.base import Box, Reader
from liferaft.state.dtypes import torch_dtype

T = TypeVar("T")
PAGE = 4096


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` ("float32", "bfloat16", ...)."""
    return torch.empty(0, dtype=torch_dtype(dtype)).element_size()


def slabs(shape: Sequence[int], item: int, slab_bytes: int) -> list[Box]:
    """Boxes of whole leading-dimension rows of a tensor of ``shape`` (``item`` bytes an element), about
    ``slab_bytes`` each, covering the tensor in order; one empty box for a 0-d tensor."""
    shape = tuple(shape)
    if not shape:
        return [((), ())]
    row = item * math.prod(shape[1:])
    rows = max(1, slab_bytes // max(row, 1))
    return [((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + shape[1:])
            for r in range(0, shape[0], rows)] or [((0,) * len(shape), shape)]


def page_aligned(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` whose first byte lies on a 4 KiB page (for O_DIRECT writes)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + nbytes]


def ring(slab_bytes: int, n: int = 3) -> list[torch.Tensor]:
    """``n`` page-aligned buffers of ``slab_bytes`` + 4 KiB, for ``slab_values``: a slab read, one written, one
    being filled."""
    return [page_aligned(slab_bytes + PAGE) for _ in range(n)]


def read_box(reader: Reader, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``box`` of tensor ``key``, read through ``reader`` (liferaft's verified; its files checked
    once per reader, not per box), into ``out`` (a uint8 buffer at least that large) when given: reusing one
    buffer saves the first touch of fresh memory for every slab."""
    dt = torch_dtype(reader.tensors[key].dtype)
    if out is None:
        target = torch.empty(box[1], dtype=dt)
    else:
        n = math.prod(box[1]) * torch.empty(0, dtype=dt).element_size()
        target = out[:n].view(dt).view(box[1])
    reader.plan([(key, box, target)]).run()
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
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who raises it
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


def slab_values(reader: Reader, key: str, slab_bytes: int, dtype: torch.dtype | None = None,
                buffers: list[torch.Tensor] | None = None,
                base: int | None = None) -> Iterator[tuple[Box, torch.Tensor]]:
    """``(box, values)`` for the row slabs of tensor ``key`` in order, read through ``reader``; cast to ``dtype``
    when given. With ``buffers`` (``ring``: uint8 buffers of at least ``slab_bytes`` + 4 KiB) slabs are read into
    them in turn (no fresh memory to touch; a consumer must be done with a slab ``len(buffers) - 1`` slabs later),
    else into new tensors. ``base``: the file offset the tensor's bytes will be written at; each slab then lies in
    its buffer on the same 4 KiB boundaries as in the file (so the writer can use O_DIRECT without a copy)."""
    spec = reader.tensors[key]
    item = itemsize(spec.dtype)
    row = item * math.prod(spec.shape[1:])
    for i, box in enumerate(slabs(spec.shape, item, slab_bytes)):
        n = item * math.prod(box[1])
        shift = (base + (box[0][0] if box[0] else 0) * row) % PAGE if base is not None else 0
        if shift % item:                        # (a view of the buffer must start on an element; the writer copies)
            shift = 0
        buf = buffers[i % len(buffers)] if buffers and shift + n <= buffers[0].numel() else None
        t = read_box(reader, key, box, out=None if buf is None else buf[shift:])
        yield box, (t.to(dtype) if dtype is not None and dtype != t.dtype else t)
