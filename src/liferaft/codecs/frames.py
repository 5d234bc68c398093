"""Chunk codecs: how an encoded chunk's hash blocks become frames, and back (docs/FORMAT.md §4.1).

An encoded chunk stores each hash block as one independent frame, so that a resharding load still reads and
decodes only the blocks it needs. Frames are produced and consumed by worker threads (zstd and numpy's copies
run without the GIL); the block hashes are always those of the raw bytes, so a read is verified after
decoding, end to end.

Codecs:
- ``bytegroup-zstd`` (lossless): ``codecs.bytegroup`` frames (byte planes + zstd, raw planes where zstd does
  not pay).
- ``q8-block`` (lossy, opt-in; floating-point only): ``codecs.quantize`` frames (int8 per block of values with
  one float32 scale each); decodes to the dequantized values, which the hashes describe.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Callable, Sequence

from liferaft.codecs import bytegroup
from liferaft.errors import CorruptCheckpointError

LOSSLESS = "bytegroup-zstd"
PAYS_RATIO = 0.97       # a chunk whose sample block does not shrink below this is stored raw

_EXECUTOR: ThreadPoolExecutor | None = None


def threads() -> int:
    """Codec worker threads: half the cores (at least 1, at most 8), so that a background save leaves the other
    half to training (measured on 2 cores: codec threads on both cores tripled the loop's stall)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def executor() -> ThreadPoolExecutor:
    """The process's codec worker threads for saves (``threads()``), created on first use."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="liferaft-codec")
    return _EXECUTOR


_LOAD_EXECUTOR: ThreadPoolExecutor | None = None


def load_executor() -> ThreadPoolExecutor:
    """Decoding threads for loads, one per core: a load has the machine to itself (training waits for it)."""
    global _LOAD_EXECUTOR
    if _LOAD_EXECUTOR is None:
        _LOAD_EXECUTOR = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                            thread_name_prefix="liferaft-decode")
    return _LOAD_EXECUTOR


def encoder(codec: str, itemsize: int, dtype: str, level: int = 1,
            raw_planes: frozenset[int] = frozenset()) -> Callable[[memoryview], bytes]:
    """The function that turns one raw block into one frame of ``codec`` (``raw_planes``: see
    ``bytegroup.incompressible``)."""
    if codec == LOSSLESS:
        return lambda block: bytegroup.encode(block, itemsize, level, raw_planes)
    if codec == "q8-block":
        from liferaft.codecs import quantize

        return lambda block: quantize.encode(block, dtype)
    raise ValueError(f"unknown codec {codec!r}")


def encode_blocks(blocks: Sequence[memoryview], codec: str, itemsize: int, dtype: str, level: int = 1,
                  pool: Executor | None = None, raw_planes: frozenset[int] = frozenset()) -> list[bytes]:
    """Frames of ``blocks``, encoded in parallel on ``pool`` (default: the process's codec threads)."""
    fn = encoder(codec, itemsize, dtype, level, raw_planes)
    if len(blocks) == 1:
        return [fn(blocks[0])]
    return list((pool or executor()).map(fn, blocks))


def decode_frames(stored: memoryview, frames: Sequence[int], codec: str, out: memoryview, block_size: int,
                  dtype: str, where: str, pool: Executor | None = None, serial: bool = False) -> None:
    """Decode consecutive ``frames`` (their stored lengths) from ``stored`` into ``out`` (the raw blocks, each
    ``block_size`` bytes except possibly the last), in parallel on ``pool`` (default: the codec threads) unless
    ``serial`` (required when called from a codec thread). Raises CorruptCheckpointError naming ``where``."""
    if sum(frames) > len(stored):
        raise CorruptCheckpointError(f"{where}: the file is truncated (read {len(stored)} of {sum(frames)} bytes)")
    jobs = []
    pos = 0
    for i, n in enumerate(frames):
        lo = i * block_size
        jobs.append((stored[pos:pos + n], out[lo:min(lo + block_size, len(out))], f"{where} block {i}"))
        pos += n
    if codec == LOSSLESS:
        def run(job: tuple[memoryview, memoryview, str]) -> None:
            bytegroup.decode(job[0], job[1], job[2])
    elif codec == "q8-block":
        from liferaft.codecs import quantize

        def run(job: tuple[memoryview, memoryview, str]) -> None:
            quantize.decode(job[0], job[1], dtype, job[2])
    else:
        raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}")
    if len(jobs) == 1 or serial:
        for job in jobs:
            run(job)
    else:
        for _ in (pool or load_executor()).map(run, jobs):
            pass
