"""Encoded chunks in flight: the writer hands a whole held chunk to the encoder and goes on with the next ones.

Without it a compressed save alternated: the writer thread waited for a chunk's frames, then wrote them while
the codec threads idled. Here the writer submits each chunk to encode (``EncodeQueue.submit``) and keeps
receiving, hashing and holding the next chunks' pieces; the frames of finished chunks go in plan order as they
come (``collect``) to the writer's I/O thread (``core.chunks.behind``), so the disk writes of chunk *i* overlap
the encoding of chunk *i + 1* and the hashing of the pieces after it.

Bounded memory: a chunk's raw bytes stay in the buffer pool until its frames are written (the pool bounds them;
when the stager waits for room, the writer completes the oldest chunk in flight first, ``_next`` in
``core.chunks.writer``); at most ``MAX_IN_FLIGHT`` chunks are encoding at once, and the frames waiting for the
I/O thread are bounded by ``core.chunks.behind.LIMIT`` (64 MiB, or one chunk's frames): handing on a chunk
waits while the frames queued before it reach that, however slow the storage.

One encoding thread per process (``chunk_executor``) runs ``Codec.encode_chunk`` for one chunk at a time; it
spreads the chunk's blocks over the codec threads (``codecs.frames.executor``), so the codec threads' count (half
the cores) still bounds the CPU a background save takes; a sync save (``foreground``), which training waits for,
spreads them over one thread per core. An exception from an encoder reaches the writer when
that chunk is completed, and fails the save (nothing is committed); ``cancel`` waits for the chunks still in
flight before their pool regions are given back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from liferaft.codecs import frames
from liferaft.codecs.base import Codec, EncodedChunk

MAX_IN_FLIGHT = 4       # chunks encoding at once: bounds the frames being made (``behind.LIMIT`` those waiting)

_LOCK = threading.Lock()
_EXECUTOR: tuple[int, ThreadPoolExecutor] | None = None


def chunk_executor() -> ThreadPoolExecutor:
    """The process's chunk-encoding thread (one; created on first use, anew in a forked child)."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None or _EXECUTOR[0] != os.getpid():
            _EXECUTOR = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="liferaft-encode"))
        return _EXECUTOR[1]


@dataclass
class InFlight:
    """One chunk being encoded: its slot in the writer's output, what it needs to be written, and the result."""

    slot: int
    future: Future[tuple[EncodedChunk | None, float]]
    held: Sequence[Any]             # the chunk's pool pieces (released once its frames are written)
    context: Any                    # what ``finish`` needs besides the encoded chunk (the writer's own)


class EncodeQueue:
    """Chunks submitted to encode, completed in submission order by ``finish(item, encoded, encode_s)``."""

    def __init__(self, finish: Callable[[InFlight, EncodedChunk | None, float], None],
                 foreground: bool = False) -> None:
        self._finish = finish
        self._foreground = foreground       # a sync save: the blocks go to the foreground codec threads
        self._q: deque[InFlight] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def submit(self, slot: int, codec: Codec, blocks: Sequence[memoryview], dtype: str, pays: float | None,
               held: Sequence[Any], context: Any) -> None:
        """Start encoding ``blocks`` (views into ``held``, which must stay valid until the chunk is finished);
        first completes the oldest chunk when ``MAX_IN_FLIGHT`` are in flight."""
        while len(self._q) >= MAX_IN_FLIGHT:
            self.complete_oldest()

        pool = frames.executor(self._foreground)

        def run() -> tuple[EncodedChunk | None, float]:
            t0 = time.perf_counter()
            enc = codec.encode_chunk(blocks, dtype, pool, pays)
            return enc, time.perf_counter() - t0

        self._q.append(InFlight(slot=slot, future=chunk_executor().submit(run), held=held, context=context))

    def complete_oldest(self) -> None:
        """Wait for the oldest chunk's frames and finish it (raises what its encoder raised)."""
        item = self._q.popleft()
        enc, took = item.future.result()
        self._finish(item, enc, took)

    def collect(self) -> None:
        """Finish every chunk at the head of the queue whose encoding is done (without waiting)."""
        while self._q and self._q[0].future.done():
            self.complete_oldest()

    def drain(self) -> None:
        """Finish every chunk in flight, in order."""
        while self._q:
            self.complete_oldest()

    def cancel(self) -> None:
        """On error: wait for every chunk still encoding (their views into the pool must end before the pool is
        reset), finishing none of them; their errors are dropped (the first error is the one raised)."""
        while self._q:
            item = self._q.popleft()
            if not item.future.cancel():
                with contextlib.suppress(BaseException):
                    item.future.result()
