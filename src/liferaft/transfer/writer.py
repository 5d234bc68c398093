"""Write this rank's share of a save plan to its data file from staged pieces, hashing each chunk in blocks."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from liferaft.codecs.checksum import BlockHasher, choose_block_size
from liferaft.errors import StorageError
from liferaft.planning.geometry import Box
from liferaft.planning.save_plan import WriteItem
from liferaft.staging.pool import BufferPool
from liferaft.staging.stager import PIECE_LIMIT, StageFailed, stage
from liferaft.storage.base import Storage


@dataclass
class WriteOutcome:
    hashes: list[tuple[int, list[str]]]      # (block size, block hashes) per item
    bytes_written: int
    stage_s: float
    write_s: float


def write_streamed(storage: Storage, items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor],
                   pool: BufferPool, block_size: int | None = None) -> WriteOutcome:
    """Write ``items`` (all in one file) from ``sources[(key, box)]`` through ``pool``; durable on return.

    A staging thread copies pieces of at most a quarter of the pool into it while this thread hashes and writes
    the previous ones (page-aligned pieces go to storage with O_DIRECT: no page cache is filled), so memory
    stays within the pool however large the state, and the copy overlaps the I/O. On error the partial file
    is removed and the error re-raised.
    """
    pieces: queue.Queue[Any] = queue.Queue()
    limit = max(1 << 20, min(PIECE_LIMIT, pool.capacity // 4))
    copy_s = [0.0]

    def run_stage() -> None:
        try:
            copy_s[0] = stage(items, sources, pool, pieces, limit)
        except BaseException:  # noqa: BLE001 - queued as StageFailed for the writer, which raises it
            pass

    stager = threading.Thread(target=run_stage, name="liferaft-stager", daemon=True)
    stager.start()
    try:
        out = write_staged(storage, items, pieces, pool, block_size)
    finally:
        stager.join()
    out.stage_s = copy_s[0]
    return out


def write_staged(storage: Storage, items: Sequence[WriteItem], pieces: "queue.Queue[Any]", pool: BufferPool,
                 block_size: int | None = None) -> WriteOutcome:
    """Write staged pieces (see ``staging.stager``) as they arrive, hashing on the fly; durable on return.

    Each piece's pool region is released once written. On error the partial file is removed, the pool is
    reset (waking a stager that waits for room) and the error re-raised.
    """
    out = WriteOutcome(hashes=[], bytes_written=0, stage_s=0.0, write_s=0.0)
    hashers = [BlockHasher(choose_block_size(w.length, block_size)) for w in items]
    writer = None
    try:
        if items:
            try:
                writer = storage.open_writer(items[0].file)
            except OSError as e:
                raise StorageError(f"{storage.url}: cannot create data file {items[0].file!r}: {e}") from e
        while True:
            piece = pieces.get()
            if piece is None:
                break
            if isinstance(piece, StageFailed):
                raise piece.error
            if piece.event is not None:
                piece.event.synchronize()
            t0 = time.perf_counter()
            mv = memoryview(piece.data.numpy()).cast("B")
            hashers[piece.item].update(mv)
            assert writer is not None
            writer.pwrite(mv, items[piece.item].byte_offset + piece.offset)
            out.write_s += time.perf_counter() - t0
            out.bytes_written += len(mv)
            del mv
            pool.release(piece.region)
        t0 = time.perf_counter()
        if writer is not None:
            writer.close()
        out.write_s += time.perf_counter() - t0
    except BaseException as e:
        if writer is not None:
            writer.abort()
        pool.reset()
        if isinstance(e, OSError):
            raise StorageError(f"{storage.url}: writing data file {items[0].file!r} failed: {e}") from e
        raise
    out.hashes = [(h.block_size, h.finish()) for h in hashers]
    return out
