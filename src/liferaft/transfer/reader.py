"""Execute planned reads: fetch whole hash blocks into a reused scratch buffer, verify, copy into targets.

Every byte is verified before any of it reaches a target tensor, so a corrupt block never lands in the state.
"""

from __future__ import annotations

from typing import Sequence

import torch

from liferaft.codecs.checksum import verify_blocks
from liferaft.errors import CorruptCheckpointError
from liferaft.planning.load_plan import ReadUnit
from liferaft.storage.base import Storage


def execute_reads(storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]],
                  targets: Sequence[torch.Tensor], copy: bool = True) -> int:
    """Run ``units`` (each with the dtype of its tensor) into ``targets``; return the bytes read.

    With ``copy=False`` the bytes are only read and verified (the first pass of an atomic load).
    """
    if not units:
        return 0
    scratch = torch.empty(max(u.length for u, _ in units), dtype=torch.uint8)
    scratch_mv = memoryview(scratch.numpy()).cast("B")
    total = 0
    for unit, dtype in units:
        mv = scratch_mv[:unit.length]
        where = f"file {unit.file!r} (key {unit.key!r}, bytes {unit.file_offset}..{unit.file_offset + unit.length})"
        try:
            n = storage.read_into(unit.file, unit.file_offset, mv)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: the file is missing from the checkpoint") from None
        if n != unit.length:
            raise CorruptCheckpointError(f"{where}: the file is truncated (got {n} of {unit.length} bytes)")
        verify_blocks(mv, unit.hashes, unit.block_size, where)
        total += n
        if not copy:
            continue
        flat = scratch[:unit.length].view(dtype)
        with torch.no_grad():
            for c in unit.copies:
                src = torch.as_strided(flat, c.sizes, c.src_strides, c.src_offset)
                dst = targets[c.target]
                for d, (o, s) in enumerate(zip(c.dest_offsets, c.sizes)):
                    dst = dst.narrow(d, o, s)
                dst.copy_(src)
    return total
