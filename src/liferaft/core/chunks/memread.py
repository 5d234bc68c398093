"""Reads from storage held in RAM (``Storage.memory_speed``: tmpfs, a memory tier's node namespace, an in-process
store): each unit streamed piece by piece through one small buffer that stays in the CPU's cache.

From a device, ``core.chunks.reader`` overlaps a reader thread's large reads with verifying and copying. From RAM
a read is itself a memory copy, and a large buffer has left the cache before its bytes are verified and copied
out: each byte then crosses memory three times (read into the buffer, read to verify and copy, written to the
target) and the buffer's first touch costs too. Here each piece of whole hash blocks (``PIECE`` bytes, a part of
the L2 cache) is read into the buffer, verified and copied into its targets at once, in this thread: every byte
is read from RAM once and written to its target once, as in a memcpy.

The reader's contract holds: no byte of a block reaches a target before that block is verified; a file shorter
than the manifest says, or a corrupt block, raises CorruptCheckpointError naming the file, the key and the bytes
(the pieces and units before it may have landed, as with any load without ``atomic``). Only raw units (no codec,
no delta) whose every copy is one contiguous run (``fused.contiguous_runs``) are streamed; the caller reads the
others the device way.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from liferaft.codecs.checksum import verify_blocks
from liferaft.core.chunks.fused import contiguous_runs, where_of
from liferaft.errors import CorruptCheckpointError
from liferaft.planning.load_plan import ReadUnit
from liferaft.staging.pool import page_aligned_empty
from liferaft.storage.base import Storage
from liferaft.storage.files import access_error, pread_full
from liferaft.storage.posix import PosixStorage
from liferaft.storage.refs import ReferencingStorage

#: Bytes read, verified and copied together (rounded down to whole hash blocks, at least one): small enough that
#: the piece is still in L2 when it is verified and copied out (measured: 256 KiB on the 1 MiB-L2 project VMs).
PIECE = 256 << 10

Run = tuple[int, int, torch.Tensor]      # (first byte in the unit, bytes, the destination's bytes)


def streamable(unit: ReadUnit, dtype: torch.dtype, targets: Sequence[torch.Tensor]) -> list[Run] | None:
    """The runs ``unit`` is copied into, if it can be streamed (raw, every copy one contiguous run); else None."""
    if unit.codec is not None or unit.delta is not None:
        return None
    runs, rest = contiguous_runs(unit, unit.length, dtype, targets)
    return None if rest else runs


class _Files:
    """Descriptors of the files read, opened through their storage's safe open (``files.open_read``: no link
    followed, regular files only) and kept open for the next piece, at most ``MAX_OPEN`` at a time (the least
    recently used closed first: a load that reads from thousands of files — many ranks' files, a long incremental
    chain — needs no more descriptors than a load from disk). A storage that reads otherwise (object stores, the
    in-process store, a subclass that changes how it reads, e.g. fault injection) is read through its
    ``read_into``."""

    MAX_OPEN = 16

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.fds: OrderedDict[str, int] = OrderedDict()

    def read(self, name: str, offset: int, out: memoryview) -> int:
        try:
            fd = self.fds.get(name)
            if fd is None:
                st, rest = self.storage.route(name) if isinstance(self.storage, ReferencingStorage) \
                    else (self.storage, name)
                if not isinstance(st, PosixStorage) or type(st).read_into is not PosixStorage.read_into:
                    return self.storage.read_into(name, offset, out)
                while len(self.fds) >= self.MAX_OPEN:
                    os.close(self.fds.popitem(last=False)[1])
                fd = self.fds[name] = st.open_read(rest)
            else:
                self.fds.move_to_end(name)
            try:
                return pread_full(fd, out, offset)
            except OSError as e:        # (as ``PosixStorage.read_into`` reports a failed read)
                raise access_error(f"{self.storage.url}: data file {name!r}", e,
                                   f"read bytes {offset}..{offset + out.nbytes} of") from None
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.storage.url}: data file {name!r} is missing") from None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def stream_units(storage: Storage, items: Sequence[tuple[ReadUnit, list[Run]]], piece: int = PIECE
                 ) -> tuple[int, float]:
    """Read, verify and copy every unit of ``items`` (each with its runs, from ``streamable``) from ``storage``
    piece by piece; return (bytes used, seconds verifying)."""
    if not items:
        return 0, 0.0
    size = max(max(1, piece // u.block_size) * u.block_size for u, _ in items)
    buf = page_aligned_empty(size)
    mv = memoryview(buf.numpy())
    src = buf.data_ptr()
    files = _Files(storage)
    used, verify_s = 0, 0.0
    try:
        for unit, runs in items:
            bs = unit.block_size
            per = max(1, piece // bs)
            where = where_of(unit)
            for first in range(0, len(unit.hashes), per):
                lo = first * bs
                hi = min(lo + per * bs, unit.length)
                n = files.read(unit.file, unit.file_offset + lo, mv[:hi - lo])
                if n < hi - lo:
                    raise CorruptCheckpointError(f"{where}: the file is truncated (read {lo + n} of {unit.length} "
                                                 "bytes). Restore from another checkpoint or copy")
                t0 = time.perf_counter()
                verify_blocks(mv[:hi - lo], unit.hashes[first:first + per], bs, where, unit.checksum, first=first)
                verify_s += time.perf_counter() - t0
                for start, count, dst in runs:
                    a, b = max(lo, start), min(hi, start + count)
                    if a < b:           # (memmove releases the GIL; a, b lie in both the piece and the run)
                        ctypes.memmove(dst.data_ptr() + a - start, src + a - lo, b - a)
            used += unit.length
    finally:
        files.close()
    return used, verify_s


__all__ = ["PIECE", "stream_units", "streamable"]
