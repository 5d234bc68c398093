"""A chunk's frames on worker threads: decoding a run of frames, and the codec thread pools (docs/FORMAT.md §4.1).

An encoded chunk stores each hash block as one independent frame of its codec (``codecs.base``, looked up by name
in ``codecs.registry``), so that a resharding load still reads and decodes only the blocks it needs. Frames are
produced and consumed by worker threads (zstd and numpy's copies run without the GIL); the block hashes are
always those of the decoded bytes, so a read is verified after decoding, end to end.

Thread pools (bounded, created on first use, shared by every save or load of the process):
- ``executor()``: ``threads()`` encoding threads for background saves (half the cores, 1 to 8);
- ``load_executor()``: one thread per usable core (at most 16) for the calls training waits for: decoding in
  loads, and encoding in synchronous saves (``executor(foreground=True)``).
Their idle threads stay until ``shutdown()`` (which a caller may use to release them; the next save or load
creates new ones) or until the interpreter exits (``concurrent.futures`` joins them then). A process forked
while they exist gets new pools on its first use (the parent's threads do not exist in the child). Each
thread holds its own zstd contexts (``codecs.bytegroup``) for its lifetime.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from liferaft.codecs.registry import LOSSLESS, get
from liferaft.errors import CorruptCheckpointError

__all__ = ["LOSSLESS", "PAYS_RATIO", "decode_frames", "executor", "foreground_threads", "load_executor", "shutdown", "threads"]

PAYS_RATIO = 0.97       # a chunk whose sample block does not shrink below this is stored raw

_LOCK = threading.Lock()
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}      # "save" / "load" → (creating pid, pool)


def threads() -> int:
    """Codec worker threads: half the cores (at least 1, at most 8), so that a background save leaves the other
    half to training (measured on 2 cores: codec threads on both cores tripled the loop's stall)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _pool(kind: str, workers: int, prefix: str) -> ThreadPoolExecutor:
    with _LOCK:
        held = _POOLS.get(kind)
        if held is None or held[0] != os.getpid():
            held = _POOLS[kind] = (os.getpid(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix))
        return held[1]


def executor(foreground: bool = False) -> ThreadPoolExecutor:
    """The process's encoding threads, created on first use: ``threads()`` of them for a save that runs beside
    training (an async save); with ``foreground``, for a save that training waits for (a sync save), the
    foreground pool of ``load_executor`` (one thread per usable core, at most 16: measured on 2 cores, a 0.54 GB
    compressed sync save took 0.97 s with 1 codec thread and 0.78 s with 2)."""
    return load_executor() if foreground else _pool("save", threads(), "liferaft-codec")


def foreground_threads() -> int:
    """Threads of the foreground pool: one per core this process may run on (its CPU affinity, not the host's
    count: 8 ranks pinned to 8 cores each get 8 each), at most 16 (several ranks per host each have one)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):         # (not on Linux)
        usable = os.cpu_count() or 1
    return max(1, min(16, usable))


def load_executor() -> ThreadPoolExecutor:
    """The foreground codec threads (``foreground_threads()``), for calls that have the machine to themselves
    (training waits for them): a load's decoding, and a sync save's encoding."""
    return _pool("load", foreground_threads(), "liferaft-decode")


def shutdown() -> None:
    """Release the codec threads (waiting for work in flight); a later save or load creates new ones."""
    with _LOCK:
        pools = [p for pid, p in _POOLS.values() if pid == os.getpid()]
        _POOLS.clear()
    for p in pools:
        p.shutdown(wait=True)


def decode_frames(stored: memoryview, frames: Sequence[int], codec: str, out: memoryview, block_size: int,
                  dtype: str, where: str, pool: Executor | None = None, serial: bool = False) -> None:
    """Decode consecutive ``frames`` (their stored lengths) from ``stored`` into ``out`` (the raw blocks, each
    ``block_size`` bytes except possibly the last), in parallel on ``pool`` (default: the decoding threads)
    unless ``serial`` (required when called from a codec thread). ``frames`` may be any run of a chunk's frames
    (a partial decode: blocks are independent). Raises CorruptCheckpointError naming ``where``."""
    impl = get(codec, where)
    if sum(frames) > len(stored):
        raise CorruptCheckpointError(f"{where}: the file is truncated (read {len(stored)} of {sum(frames)} bytes)")
    if block_size < 1 or len(frames) != -(-len(out) // block_size):
        raise CorruptCheckpointError(f"{where}: {len(frames)} frame(s) for {len(out)} bytes in blocks of "
                                     f"{block_size}")
    jobs = []
    pos = 0
    for i, n in enumerate(frames):
        lo = i * block_size
        jobs.append((stored[pos:pos + n], out[lo:min(lo + block_size, len(out))], f"{where} block {i}"))
        pos += n

    def run(job: tuple[memoryview, memoryview, str]) -> None:
        impl.decode_block(job[0], job[1], dtype, job[2])

    if len(jobs) == 1 or serial:
        for job in jobs:
            run(job)
    else:
        for _ in (pool or load_executor()).map(run, jobs):
            pass
