"""Execute planned reads: a pipeline of large aligned reads → verify → copy into the live tensors.

Units (whole hash blocks of one chunk, see ``planning.load_plan``) are sorted by file and offset and coalesced
into physical reads of up to ``max_read`` bytes, aligned to 4 KiB so that storage may use direct I/O (no page
cache: on these VMs the page cache costs a first touch of fresh memory per byte). A reader thread fills one
of two page-aligned scratch buffers while the caller's thread verifies and copies the other. Every block is
verified before any of its bytes reach a target tensor, so a corrupt block never lands in the state.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from liferaft.codecs.checksum import verify_blocks
from liferaft.errors import CorruptCheckpointError
from liferaft.planning.load_plan import ReadUnit
from liferaft.staging.pool import PAGE, page_aligned_empty
from liferaft.storage.base import Storage

@dataclass
class _Batch:
    """One physical read: ``length`` bytes of ``file`` at ``offset`` (page aligned) holding ``units``."""

    file: str
    offset: int
    length: int
    units: list[tuple[ReadUnit, torch.dtype]]

    @property
    def needed_end(self) -> int:
        return max(u.file_offset + u.length for u, _ in self.units) - self.offset


def _batches(units: Sequence[tuple[ReadUnit, torch.dtype]], max_read: int) -> list[_Batch]:
    """Coalesce units into physical reads of whole pages (so that storage may use O_DIRECT), at most
    ``max_read`` bytes each. (Measured: reading the partial units of a resharding load through the page cache
    instead, to share it between the ranks of a node, was not faster here.)"""
    out: list[_Batch] = []
    for unit, dtype in sorted(units, key=lambda ud: (ud[0].file, ud[0].file_offset)):
        lo = unit.file_offset // PAGE * PAGE
        hi = -(-(unit.file_offset + unit.length) // PAGE) * PAGE
        last = out[-1] if out else None
        if last is not None and last.file == unit.file and lo <= last.offset + last.length + PAGE \
                and max(hi, last.offset + last.length) - last.offset <= max_read:
            last.length = max(hi, last.offset + last.length) - last.offset
            last.units.append((unit, dtype))
        else:
            out.append(_Batch(unit.file, lo, hi - lo, [(unit, dtype)]))
    return out


def execute_reads(storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]],
                  targets: Sequence[torch.Tensor], copy: bool = True, max_read: int = 32 << 20) -> int:
    """Run ``units`` (each with the dtype of its tensor) into ``targets``; return the bytes read.

    With ``copy=False`` the bytes are only read and verified (the first pass of an atomic load).
    """
    if not units:
        return 0
    batches = _batches(units, max(max_read, max(-(-(u.length + 2 * PAGE) // PAGE) * PAGE for u, _ in units)))
    size = max(b.length for b in batches)
    free: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(2 if len(batches) > 1 else 1):
        free.put(page_aligned_empty(size))
    ready: queue.Queue[tuple[_Batch, torch.Tensor, int] | BaseException | None] = queue.Queue()
    stop = threading.Event()

    def read_all() -> None:
        try:
            for b in batches:
                buf = free.get()
                if stop.is_set():
                    return
                try:
                    n = storage.read_into(b.file, b.offset, memoryview(buf[:b.length].numpy()))
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{storage.url}: data file {b.file!r} is missing") from None
                ready.put((b, buf, n))
            ready.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            ready.put(e)

    reader = threading.Thread(target=read_all, name="liferaft-reader", daemon=True)
    reader.start()
    total = 0
    try:
        while True:
            item = ready.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            batch, buf, n = item
            _consume(batch, buf, n, targets, copy)
            total += sum(u.length for u, _ in batch.units)
            free.put(buf)
    finally:
        stop.set()
        free.put(torch.empty(0, dtype=torch.uint8))     # unblock a reader waiting for a buffer
        reader.join()
    return total


def _consume(batch: _Batch, buf: torch.Tensor, n: int, targets: Sequence[torch.Tensor], copy: bool) -> None:
    for unit, dtype in batch.units:
        inner = unit.file_offset - batch.offset
        where = f"file {unit.file!r} (key {unit.key!r}, bytes {unit.file_offset}..{unit.file_offset + unit.length})"
        if n < inner + unit.length:
            raise CorruptCheckpointError(f"{where}: the file is truncated (read {max(0, n - inner)} of "
                                         f"{unit.length} bytes)")
        view = buf[inner:inner + unit.length]
        verify_blocks(memoryview(view.numpy()), unit.hashes, unit.block_size, where)
        if not copy:
            continue
        flat = view.view(dtype)
        with torch.no_grad():
            for c in unit.copies:
                src = torch.as_strided(flat, c.sizes, c.src_strides, flat.storage_offset() + c.src_offset)
                dst = targets[c.target]
                for d, (o, s) in enumerate(zip(c.dest_offsets, c.sizes)):
                    dst = dst.narrow(d, o, s)
                dst.copy_(src)
