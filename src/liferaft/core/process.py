"""What one process keeps between saves: :data:`PROCESS`, the one :class:`ProcessState` of the process.

It holds the buffer pool an ``async_save`` snapshots into (``pool``, one snapshot's worth or ``memory_budget``),
the small ring a sync ``save`` streams through when there is no such pool (``ring``, at most 64 MiB), and the
async save in flight (``inflight``; ``settle`` applies ``SaveOptions.if_busy`` to it). Both ``save`` and
``async_save`` go through it, so a sync save reuses the async pool's pages and waits for (or refuses) a save
still running.

Lifetime: nothing is allocated until the first save. A pool is kept for later saves (its pages are faulted in:
reusing it is what makes the next snapshot fast) and replaced when a save needs a larger one, one of another
kind (pinned or not) or one within a smaller budget. The in-flight handle is dropped by the next save (after
waiting for it). :meth:`ProcessState.release` (through ``liferaft.release()``) waits for the save in flight and
drops both pools; otherwise they live until the process exits.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from liferaft.dist import Coordinator
from liferaft.errors import CheckpointBusyError, LiferaftError
from liferaft.format.jsonsafe import GC_PAUSE
from liferaft.options import SaveOptions, SaveResult
from liferaft.staging.pool import BufferPool, PoolClosedError

SYNC_RING = 64 << 20        # the ring a sync save streams through, unless the async pool is there

F = TypeVar("F", bound=Callable[..., Any])


class CallGate:
    """Keeps ``liferaft.release()`` out of the way of liferaft calls running in other threads, and Python's cyclic
    garbage collector out of the calls of the main thread.

    Every public call that uses what ``release`` frees (the pools, the codec threads, the gloo groups) runs inside
    :meth:`call` (the decorator :func:`in_call`); :meth:`exclusive` (``release``) waits until no call runs and holds
    new calls back until it is done. ``release`` from inside a call of its own thread (a ``state_dict()`` hook
    calling it) cannot wait for itself: CheckpointBusyError.

    While a call of the main thread runs (where a training loop waits for it), the cyclic collector is paused
    (``format.jsonsafe.GC_PAUSE``: disabled if it was enabled, enabled again once no holder is left, however the
    call returns; a collector the caller disabled — Megatron's ``--manual-gc``, torchtitan's ``gc_freq`` — stays
    disabled). A call keeps several objects per key to its end (the flattened state, the plan, the manifest's
    records), which set off full collections that traverse every object of the process (~0.1 s each with torch
    loaded) and free nothing: a save of 20,000 small tensors ran 6–8 of them. Calls of other threads do not pause
    it (the training loop may run meanwhile). A forked child starts with no call running and the collector as it
    was before the calls.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._releasing = False
        self._local = threading.local()
        self._forks = False             # the at-fork hook is registered

    @contextmanager
    def call(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        with self._cond:
            while self._releasing and depth == 0:
                self._cond.wait()
            if not self._forks and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._in_child)
                self._forks = True
            self._active += 1
        pid = os.getpid()
        self._local.depth = depth + 1
        pause = depth == 0 and threading.current_thread() is threading.main_thread()
        try:
            if pause:
                GC_PAUSE.hold()
            yield
        finally:
            self._local.depth = depth
            if os.getpid() == pid:      # (a child forked in the call starts with none running)
                if pause:
                    GC_PAUSE.drop()
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def _in_child(self) -> None:
        """After a fork: no call runs in the child (the parent's other threads are not there; the lock they may
        have held is replaced)."""
        self._cond = threading.Condition()
        self._active = 0
        self._releasing = False

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise CheckpointBusyError("liferaft.release() was called from inside a liferaft call of the same thread "
                                      "(a state_dict() or load_state_dict() hook?): call it after the save or load "
                                      "returns")
        with self._cond:
            while self._releasing:
                self._cond.wait()
            self._releasing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._releasing = False
                self._cond.notify_all()


#: The process's one gate between liferaft calls and ``release``.
CALLS = CallGate()


def in_call(fn: F) -> F:
    """Run ``fn`` inside ``CALLS.call()`` (a ``release`` from another thread waits for it to return)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CALLS.call():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


class AsyncSaveHandle:
    """A save running in the background. ``wait_staged()``: the snapshot is taken (the state may change);
    ``wait()``: the checkpoint is committed (returns the SaveResult, or raises what any rank raised)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._staged = threading.Event()
        self._done = threading.Event()
        self._stage_error: BaseException | None = None
        self._error: BaseException | None = None
        self._result: SaveResult | None = None
        self._observed = False
        #: the save's threads (writer, stager): joined once it is done, so that none is still winding down when
        #: the caller goes on (a daemon thread still running at the interpreter's exit aborted the process)
        self._threads: list[threading.Thread] = []

    def done(self) -> bool:
        """True once the save has finished, successfully or not."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until this rank's snapshot is complete (immediate for blocking staging). Raises the snapshot's
        error, if it failed: the save failed, and the caller has been told (a later save does not report it again
        as a failure nobody waited for)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"snapshot for {self.path} not complete within {timeout}s")
        if self._stage_error is not None and not isinstance(self._stage_error, PoolClosedError):
            self._observed = True
            raise self._stage_error
        if self._stage_error is not None:   # the writer failed first; its error is the real one
            self.wait()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the checkpoint is committed; return its SaveResult or raise the save's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.path} not finished within {timeout}s")
        self._join()
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _join(self) -> None:
        """Join the save's threads (done: they only return from here on); never the calling thread."""
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


class ProcessState:
    """The buffer pools and the async save in flight of one process (see the module doc for their lifetime).
    Used from the caller's thread of ``save``/``async_save`` only (the writer threads get their pool passed)."""

    def __init__(self) -> None:
        self.pool: BufferPool | None = None
        self.ring: BufferPool | None = None
        self.inflight: AsyncSaveHandle | None = None
        self._gate = threading.Lock()
        self._owner: int | None = None

    @contextmanager
    def one_save(self, opts: SaveOptions, process_group: Any) -> Iterator[bool]:
        """One save of this process at a time from here (``settle``, the pools) until it is done (``save``) or in
        flight (``async_save``: ``inflight`` set, which the next one settles first): two threads saving at once
        staged into one pool (a committed checkpoint held another save's bytes). Yields whether to go on: a save of
        one process with ``if_busy="skip"`` skips (False) while another thread's save runs, with "raise" raises
        CheckpointBusyError; otherwise it waits, at most ``opts.timeout`` (then CheckpointBusyError: a
        ``state_dict()`` that saves from a helper thread it joins would wait for itself). A save from inside a save
        of the same thread cannot wait for itself: CheckpointBusyError."""
        if self._owner == threading.get_ident():
            raise CheckpointBusyError("save/async_save was called from inside a save of the same thread (a "
                                      "state_dict() hook?); save after that save returns")
        if opts.if_busy != "wait" and _world(process_group) == 1:
            got = self._gate.acquire(blocking=False)
            if not got and opts.if_busy == "skip":
                yield False
                return
        else:
            got = self._gate.acquire(timeout=opts.timeout)
        if not got:
            raise CheckpointBusyError("another thread of this process is saving (if_busy='raise', or it ran past "
                                      f"the timeout of {opts.timeout:g} s); one save of a process runs at a time")
        self._owner = threading.get_ident()
        try:
            yield True
        finally:
            self._owner = None
            self._gate.release()

    def pool_for(self, nbytes: int, budget: int | None, pin: bool) -> BufferPool:
        """The pool for a save of ``nbytes``: one snapshot's worth, or ``budget`` if that is smaller. An
        existing pool is reused (emptied: no save is using it) when it is large enough and within the budget."""
        need = max(1 << 20, nbytes if budget is None else min(budget, nbytes))
        pool = self.pool
        if pool is not None and pool.pinned == pin and pool.capacity >= need and \
                (budget is None or pool.capacity <= budget):
            pool.reset()                             # regions a failed save left behind
            return pool
        self.pool = None                             # drop the old buffer before allocating the new one
        self.pool = BufferPool(need, pin=pin)
        return self.pool

    def ring_for(self, nbytes: int, budget: int | None, pin: bool) -> BufferPool:
        """The pool a sync save streams through (no async save may be in flight): the async pool when there is
        one of the right kind and size (its pages are already faulted in), else a small ring kept for reuse."""
        need = max(1 << 20, min(nbytes, SYNC_RING if budget is None else min(budget, SYNC_RING)))
        for pool in (self.pool, self.ring):
            if pool is not None and pool.pinned == pin and pool.capacity >= need and \
                    (budget is None or pool.capacity <= budget):
                pool.reset()                         # regions a failed save left behind
                return pool
        self.ring = None
        self.ring = BufferPool(need, pin=pin)
        return self.ring

    def settle(self, opts: SaveOptions, process_group: Any) -> bool:
        """Apply ``if_busy`` to an async save of this process still in flight; surface an unobserved failure.

        Returns False when this save must be skipped. With "skip"/"raise" the ranks agree first (one exchange),
        so that every rank skips or raises together.
        """
        prev = self.inflight
        if opts.if_busy != "wait":
            coord = Coordinator(process_group, opts.timeout)
            busy = any(coord.exchange(prev is not None and not prev.done(), None, "save (busy check)"))
            if busy and opts.if_busy == "skip":
                return False
            if busy:
                raise CheckpointBusyError("an async save is still in flight on some rank (if_busy='raise'); call "
                                          "handle.wait() first or use if_busy='wait'/'skip'")
        self._finish_inflight()
        return True

    def release(self) -> None:
        """Wait for the async save in flight, then drop both pools (their memory goes once no snapshot refers to
        it). Not collective. Raises, after releasing, the error of an async save nobody waited for."""
        try:
            self._finish_inflight()
        finally:
            self.pool = self.ring = None

    def _finish_inflight(self) -> None:
        prev = self.inflight
        if prev is None:
            return
        prev._done.wait()
        prev._join()
        self.inflight = None
        if prev._error is not None and not prev._observed:
            prev._observed = True
            raise LiferaftError(f"the previous async save to {prev.path} failed and nobody waited for it: "
                                f"{type(prev._error).__name__}: {prev._error}") from prev._error


def _world(process_group: Any) -> int:
    """The number of ranks of ``process_group`` (1 without torch.distributed): no collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(process_group))


#: The process's one ProcessState.
PROCESS = ProcessState()


def finish_at_exit() -> None:
    """At the interpreter's exit: let an async save still in flight finish (it commits, or fails within its
    timeout) and its threads end, before the interpreter tears down what they use. Registered by ``async_save``
    (again at each call, so that it runs before the exit hooks of what the save uses, made earlier)."""
    prev = PROCESS.inflight
    if prev is not None:
        prev._done.wait()
        prev._join()
