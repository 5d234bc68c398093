"""The manager's saves under way: at most one save to the root in flight (``async_save``) or one full step draining
from the memory tier to the root, and the newest committed step (the base of the next incremental save).

A component of ``CheckpointManager``: it starts the saves the manager decided on, says which steps are busy (no
retention pass deletes them) and returns each save once it has committed (``Finished``), for the manager to account
for; waiting raises what the save raised, on every rank (the saves are collective). It holds no reference to the
manager (no cycle: a manager is freed as soon as its script drops it, not at the interpreter's exit).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.manager.tiering import Tiers
from liferaft.options import SaveOptions, SaveResult
from liferaft.storage import Storage


@dataclass(frozen=True)
class Finished:
    """A save of the manager that committed."""
    step: int
    metrics: Mapping[str, float]
    since_full: int                 # saves since a full one (0: this one is full)
    result: SaveResult | None       # None: a step drained from the memory tier


@dataclass(frozen=True)
class _Async:
    step: int
    handle: AsyncSaveHandle
    metrics: Mapping[str, float]
    since_full: int
    references: int | None          # the committed step this (incremental) save references


class SavesInFlight:
    """At most one save under way (the manager waits for it before it starts another) and the newest committed
    step. ``stall`` is how long the last save held the caller (the snapshot, or the whole save when waited)."""

    def __init__(self, tiers: Tiers | None, process_group: Any) -> None:
        self._tiers = tiers
        self._group = process_group
        self._async: _Async | None = None
        self._draining: tuple[int, Mapping[str, float]] | None = None
        #: (newest committed step, its saves since a full one); None: the next save to the root is a full one
        self.base: tuple[int, int] | None = None
        self.stall = 0.0
        #: when the last save began (``time.perf_counter``): a drained step's time until committed is at most now
        #: minus this once it is seen committed
        self.began = 0.0

    @property
    def busy(self) -> bool:
        """Whether a save is under way (finished or not: not yet accounted for by ``settle``/``wait``)."""
        return self._async is not None or self._draining is not None

    def finished(self) -> int | None:
        """The step of the save under way if this rank sees it finished (not yet accounted for), else None."""
        if self._async is not None and self._async.handle.done():
            return self._async.step
        if self._draining is not None and self._tiers is not None and not self._tiers.busy:
            return self._draining[0]
        return None

    def busy_steps(self) -> set[int]:
        """The steps a retention pass must leave alone: the one being saved and the base it references."""
        a = self._async
        return set() if a is None else {a.step} | ({a.references} if a.references is not None else set())

    def save(self, step: int, state: Any, target: Storage, opts: SaveOptions, metrics: Mapping[str, float] | None,
             since_full: int, references: int | None, wait: bool) -> list[Finished]:
        """Save ``state`` to ``target`` (a step under the root): committed before returning when ``wait`` (and
        returned), else in flight once the snapshot is taken. Nothing may be under way (the manager waited)."""
        assert not self.busy
        t0 = self.began = time.perf_counter()
        if wait:
            res = save(target, state, process_group=self._group, options=opts)
            self.stall = time.perf_counter() - t0
            return [self._done(step, dict(metrics or {}), since_full, res)]
        handle = async_save(target, state, process_group=self._group, options=opts)
        assert handle is not None
        self.stall = time.perf_counter() - t0
        self._async = _Async(step, handle, dict(metrics or {}), since_full, references)
        return []

    def drain_save(self, step: int, state: Any, opts: SaveOptions, metrics: Mapping[str, float] | None,
                   wait: bool) -> list[Finished]:
        """Save into the memory tier and drain that copy to the root in the background (a full step; committed
        and returned when ``wait``)."""
        assert self._tiers is not None and not self.busy
        t0 = self.began = time.perf_counter()
        self._tiers.drain_save(step, state, opts, wait=wait)
        self.stall = time.perf_counter() - t0
        self._draining = (step, dict(metrics or {}))
        return self.wait() if wait else []

    def drained_in(self) -> float:
        """The last drained step's time from its start to its commit on the root (the memory tier's record of when
        its background work ended; else until now: it was seen committed by now)."""
        done = self._tiers.memory.done_at if self._tiers is not None else None
        end = done if done is not None and done >= self.began else time.perf_counter()
        return end - self.began

    def settle(self) -> list[Finished]:
        """The save under way if it has finished (raises its error), else nothing."""
        return self.wait() if self.finished() is not None else []

    def wait(self) -> list[Finished]:
        """Wait for the save under way and return it (raises what it raised, on every rank)."""
        if self._draining is not None and self._tiers is not None:
            step, metrics = self._draining
            self._draining = None
            self._tiers.wait()
            return [self._done(step, metrics, 0, None)]
        if self._async is None:
            return []
        a, self._async = self._async, None
        return [self._done(a.step, a.metrics, a.since_full, a.handle.wait())]

    def _done(self, step: int, metrics: Mapping[str, float], since_full: int, result: SaveResult | None) -> Finished:
        self.base = (step, since_full)
        return Finished(step, metrics, since_full, result)
