"""The native save entry points: ``save`` (sync) and ``async_save``.

save: prepare (flatten, exchange, plan) → write this rank's chunks, streamed through a small reused ring →
finish (hashes, manifest, ``COMMIT``), the phases in ``core.phases``. async_save: the same phases, with the
training thread stalled only for the snapshot into the process's buffer pool; hashing, writing and the commit
run in the background. Sequence on every rank: settle the previous async save (``if_busy``) → prepare
(collective, caller's thread) → start the writer thread → stage the snapshot into the process's buffer pool (in
the caller's thread for "blocking" staging, in a staging thread for "overlapped") → the writer writes pieces as
they arrive, then runs the exchanges and the commit on the "bg" gloo channel. Errors of any rank surface on
``wait()`` on every rank, and at the next save if nobody waited.

``release``: free what the process keeps between saves (``core.process.PROCESS``'s pools, ``core.phases.PLANS``,
the gloo groups of ``dist``); each module's doc says what it keeps and for how long.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from liferaft.codecs import frames
from liferaft.core.caches import INFERRED, PLANS, STAGED, TILED
from liferaft.core.chunks.writer import WriteOutcome, write_staged, write_streamed
from liferaft.core.commit import forget_opened
from liferaft.core.phases import PreparedSave, finish_save, prepare_save
from liferaft.core.process import CALLS, PROCESS, AsyncSaveHandle, finish_at_exit, in_call
from liferaft.dist import Coordinator, release_groups
from liferaft.options import SaveOptions, SaveResult, check_options, check_path
from liferaft.planning.save_plan import page_phase
from liferaft.staging.pool import BufferPool
from liferaft.staging.stager import PIECE_LIMIT, PieceQueue, stage, staged_size, streamed_piece_limit
from liferaft.storage import resolve

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AsyncSaveHandle", "async_save", "release", "save"]

PathLike = str | os.PathLike[str]


@in_call
def save(path: PathLike, state: Any, *, process_group: ProcessGroup | None = None,
         options: SaveOptions | None = None) -> SaveResult | None:
    """Save ``state`` to ``path``, collectively over ``process_group`` (default: the world, or one process).

    ``state`` is any nesting of dict/list/tuple holding tensors (replicated), DTensors, :class:`Sharded`
    shards, objects with ``state_dict()``/``load_state_dict()`` and plain values. The checkpoint exists only
    once every rank's data is durable and the commit marker is written; on any failure every rank raises and
    a checkpoint previously at ``path`` is untouched. Waits for (or skips / refuses, per
    ``SaveOptions.if_busy``) an ``async_save`` of this process still in flight; returns None, on every rank,
    when it skipped (``if_busy="skip"``: nothing was written), else what it did.

    The bytes stream through a small ring of host memory (64 MiB, or ``memory_budget`` if smaller; the
    ``async_save`` pool when the process has one), kept for later saves: a copy into it overlaps the direct
    (O_DIRECT) write of the previous piece, so no page cache is filled and extra memory stays bounded: the ring,
    plus, for compressed chunks, the frames being encoded (4 chunks at most) and those waiting to be written
    (``core.chunks.behind.LIMIT``, 64 MiB). A large chunk of a host tensor lying where its file range lies within a
    page (64 bytes in: ``planning.save_plan.place``; a large tensor as torch's allocator gives it out) is written
    from the tensor's own memory, uncopied.

    The state must not change until ``save`` returns (it is the caller's training step that waits): a tensor
    another thread writes into meanwhile leaves a checkpoint whose checksums do not match that tensor's stored
    bytes — committed, and refused by every load and ``verify`` naming the chunk. To keep training while saving,
    use ``async_save``, whose snapshot is taken before it returns.
    """
    check_path(path, "save(path=...)")
    opts = check_options(options, SaveOptions, "save")
    with PROCESS.one_save(opts, process_group) as go:    # (one save of the process at a time: its pools)
        return _save(path, state, process_group, opts) if go else None


def _save(path: PathLike, state: Any, process_group: ProcessGroup | None, opts: SaveOptions) -> SaveResult | None:
    if not PROCESS.settle(opts, process_group):
        return None  # if_busy="skip"
    coord = Coordinator(process_group, opts.timeout)
    prep = prepare_save(state, coord, resolve(path), opts)
    pool: BufferPool | None = None

    def write() -> WriteOutcome:
        nonlocal pool
        pin = torch.cuda.is_available() and any(t.is_cuda for t in prep.sources.values())
        nbytes = staged_size(prep.writes, prep.sources, 1 << 20,     # (with the padding of the smallest pieces)
                             page_phase(prep.policy.alignment))
        pool = PROCESS.ring_for(nbytes, opts.memory_budget, pin)
        policy = dataclasses.replace(prep.policy, foreground=True)      # (training waits: every core encodes)
        # (the state does not change until this call returns: raw chunks of host tensors go uncopied)
        outcome = write_streamed(prep.storage, prep.writes, prep.sources, pool, policy, sources_stable=True)
        prep.storage.sync()   # this rank's new folder entries are durable too, not only its file
        return outcome

    try:
        result = finish_save(coord, prep, write, opts)
    finally:
        prep.release()
    return dataclasses.replace(result, staging_bytes=pool.capacity if pool is not None else 0)


@in_call
def async_save(path: PathLike, state: Any, *, process_group: ProcessGroup | None = None,
               options: SaveOptions | None = None) -> AsyncSaveHandle | None:
    """Start a save of ``state`` to ``path``; return once this rank's snapshot is taken (``staging="blocking"``)
    or at once (``"overlapped"``: call ``handle.wait_staged()`` before changing the state). Collective, like
    ``save``; returns None when skipped by ``if_busy="skip"``. The snapshot lives in a per-process buffer pool
    of at most ``memory_budget`` bytes that is reused by later saves."""
    check_path(path, "async_save(path=...)")
    opts = check_options(options, SaveOptions, "async_save")
    with PROCESS.one_save(opts, process_group) as go:    # (until it is in flight: the next one settles it)
        return _async_save(path, state, process_group, opts) if go else None


def _async_save(path: PathLike, state: Any, process_group: ProcessGroup | None,
                opts: SaveOptions) -> AsyncSaveHandle | None:
    t_call = time.perf_counter()
    if not PROCESS.settle(opts, process_group):
        return None
    coord = Coordinator(process_group, opts.timeout)
    bg = Coordinator(process_group, opts.timeout, channel="bg")     # created here, used by the writer thread
    prep = prepare_save(state, coord, resolve(path), opts)
    try:
        return _start(prep, coord, bg, opts, t_call)
    except BaseException:
        prep.release()                  # (nothing in flight: the folder is free again)
        raise


def _start(prep: PreparedSave, coord: Coordinator, bg: Coordinator, opts: SaveOptions,
           t_call: float) -> AsyncSaveHandle:
    """Start the stager and the writer of a prepared async save (``async_save``)."""
    items = prep.writes
    pin = torch.cuda.is_available() and any(t.is_cuda for t in prep.sources.values())
    nbytes = staged_size(items, prep.sources, PIECE_LIMIT, page_phase(prep.policy.alignment))
    pool = PROCESS.pool_for(nbytes, opts.memory_budget, pin)
    handle = AsyncSaveHandle(prep.storage.url)
    pieces = PieceQueue()
    limit = PIECE_LIMIT if nbytes <= pool.capacity else streamed_piece_limit(pool.capacity)

    def run_stage() -> None:
        t0 = time.perf_counter()
        try:
            stage(items, prep.sources, pool, pieces, limit, phase=page_phase(prep.policy.alignment),
                  one_thread=opts.staging == "overlapped")
        except BaseException as e:  # noqa: BLE001 - reported via the handle and the writer
            handle._stage_error = e
        prep.timings["stage"] = time.perf_counter() - t0
        handle._staged.set()

    # When the whole snapshot fits, the writer starts after it: on a small machine a concurrent writer takes
    # memory bandwidth and a core from the copy, and the copy is what the caller waits for.
    hold = handle._staged if nbytes <= pool.capacity else None
    writer = threading.Thread(target=_write_and_commit, args=(bg, prep, pieces, pool, opts, handle, hold),
                              name="liferaft-writer", daemon=True)
    PROCESS.inflight = handle
    handle._threads.append(writer)
    atexit.unregister(finish_at_exit)                   # (last registered: runs before what it uses goes)
    atexit.register(finish_at_exit)
    writer.start()
    if opts.staging == "overlapped":
        stager = threading.Thread(target=run_stage, name="liferaft-stager", daemon=True)
        handle._threads.append(stager)
        stager.start()
    else:
        run_stage()
    prep.timings["blocked"] = time.perf_counter() - t_call
    return handle


def _write_and_commit(coord: Coordinator, prep: PreparedSave, pieces: PieceQueue, pool: BufferPool,
                      opts: SaveOptions, handle: AsyncSaveHandle, hold: threading.Event | None) -> None:
    def write() -> WriteOutcome:
        try:
            # (unless the stager runs out of room after all: then the writer must start freeing it)
            while hold is not None and not hold.wait(0.01) and not pool.waiting:
                pass
            outcome = write_staged(prep.storage, prep.writes, pieces, pool, prep.policy)
            prep.storage.sync()
            return outcome
        finally:
            handle._staged.wait()       # the snapshot is complete (or failed) before the outcome is exchanged

    try:
        result = finish_save(coord, prep, write, opts)
        handle._result = SaveResult(**{**result.__dict__, "staging_bytes": pool.capacity})
    except BaseException as e:  # noqa: BLE001 - surfaces on wait()
        handle._error = e
    finally:
        prep.release()                  # (before done: a save waiting for this one finds the folder free)
        handle._done.set()


def release() -> None:
    """Free what liferaft keeps in this process between calls: wait for an ``async_save`` still in flight, then
    drop the buffer pools ``save``/``async_save`` reuse, the cached save plans, the manifest kept for reuse by
    the one-process tools (``core.commit.forget_opened``), the codec threads (``codecs.frames.shutdown``) and
    liferaft's gloo groups (of every process group). Not collective; the next
    call makes what it needs anew (a first save is then as slow as the very first). Raises, after freeing
    everything, the error of an async save that failed while nobody waited for it. Called from another thread
    while a liferaft call (save, load, read, verify, diff, convert, ...) runs there, it waits for that call to
    return and holds new ones back until it is done; called from inside one (a ``state_dict()`` hook), it raises
    CheckpointBusyError."""
    with CALLS.exclusive():
        try:
            PROCESS.release()
        finally:
            PLANS.clear()
            TILED.clear()
            INFERRED.clear()
            STAGED.clear()
            forget_opened()
            frames.shutdown()
            release_groups()
