"""The CUDA tensors of the per-step log's records (``tiers.steplog``): copied on a side stream into pinned memory
when captured, written into the record (and hashed) when it is published, off the training thread.

The training thread only enqueues copies: ``enqueue`` orders each after the work the training stream has queued
so far (the gradient is computed), and ``fence`` orders the training stream after them (what runs next — the
optimizer's kernels, ``zero_grad(set_to_none=False)``, the next forward changing a buffer — must not touch a
tensor before its copy has read it). ``drain`` (the replication thread) waits for each copy's event and writes
the pinned bytes into the slot with numpy's copy and hashes each 16 MiB piece right after its copy (XXH3-64 from
python-xxhash), both without the GIL: a Python training loop is not stalled by them. The background thread
sets each copy's device before waiting for its event (a thread's CUDA device is 0 until set: waiting there would
make a context on GPU 0 in every rank).

Pinned buffers come in two generations, one per record in turn: while a record's copies are drained in the
background, the next record's copies fill the other generation. A record's drain is waited for (``StepLog.wait``)
before the record after next begins, so a generation is never written while it is read.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from liferaft.codecs.checksum import stream as hasher
from liferaft.tiers.steprecord import RECORD_CHECKSUM, entry_of
from liferaft.tiers.stepslot import Slot

#: one enqueued copy: (pinned buffer, its event, offset in the record, the header entry to fill, device)
Copy = tuple[torch.Tensor, Any, int, dict[str, Any], torch.device]


class CudaCopies:
    """The copies of CUDA tensors of the record being captured (``pending``) and the buffers they go to."""

    def __init__(self) -> None:
        self.pending: list[Copy] = []
        self._streams: dict[torch.device, Any] = {}        # a side stream per CUDA device
        self._pinned: list[dict[tuple[Any, ...], torch.Tensor]] = [{}, {}]

    def enqueue(self, t: torch.Tensor, off: int, gen: int) -> dict[str, Any]:
        """Copy the CUDA tensor ``t`` (stored at ``off`` of a record of generation ``gen``) into pinned memory on
        its device's side stream; return its header entry, filled by ``drain``."""
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(device=t.device)
        key = (off, tuple(t.shape), t.dtype)
        buffers = self._pinned[gen]
        pinned = buffers.get(key)
        if pinned is None:
            pinned = buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            pinned.copy_(t, non_blocking=True)
            t.record_stream(stream)
            done = torch.cuda.Event(blocking=True)      # (waited for on the background thread: sleeps, not spins)
            done.record(stream)
        entry: dict[str, Any] = {}
        self.pending.append((pinned, done, off, entry, t.device))
        return entry

    def fence(self, since: int) -> None:
        """Order each device's training stream after the copies enqueued since ``pending[since]`` (the copies of
        one device run in order on its side stream: waiting for the stream covers them all)."""
        for dev in {c[4] for c in self.pending[since:]}:
            torch.cuda.current_stream(dev).wait_stream(self._streams[dev])

    def drop(self, since: int) -> None:
        """Forget the copies enqueued since ``pending[since]`` (their step did not run; fenced first)."""
        del self.pending[since:]

    def take(self) -> list[Copy]:
        """The record's copies, handed to ``drain``; ``pending`` starts empty for the next record."""
        out, self.pending = self.pending, []
        return out

    def drain(self, f: Slot, copies: list[Copy], gen: int) -> None:
        """Write ``copies`` (of a record of generation ``gen``) into the slot ``f`` from their pinned buffers, each
        waited for, filling their header entries. That generation's buffers the record did not use are dropped
        (a layout that moved the tensors' offsets does not leave them held for the life of the process)."""
        used = set()
        for pinned, done, off, entry, dev in copies:
            with _on(dev):                  # (this thread's device is 0 until set: no context made on GPU 0)
                done.synchronize()
            h = hasher(RECORD_CHECKSUM)
            f.copy_in(off, pinned, h.update)     # (without the GIL: the training thread runs meanwhile)
            entry.update(entry_of(off, pinned, pinned.numel() * pinned.element_size(), h.hexdigest()))
            used.add(id(pinned))
        buffers = self._pinned[gen]
        if len(used) < len(buffers):        # (freed into torch's pinned-memory cache, not to the system)
            with _on(copies[0][4] if copies else None):
                self._pinned[gen] = {k: v for k, v in buffers.items() if id(v) in used}
                del buffers


def _on(dev: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """``dev`` as this thread's current CUDA device for the block (nothing for another device or None)."""
    return torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else contextlib.nullcontext()


__all__ = ["Copy", "CudaCopies"]
