"""Reading one tensor of a checkpoint in slabs of leading-dimension rows (bounded memory), for the tools."""

from __future__ import annotations

from typing import Any

import torch

from liferaft.format.manifest import TensorEntry
from liferaft.planning.load_plan import plan_reads
from liferaft.transfer.reader import execute_reads
from liferaft.transfer.tensors import torch_dtype


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
