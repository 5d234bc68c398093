"""The save's process-wide caches (dropped by ``liferaft.release()``): :data:`PLANS`, the last tensor layout planned
per group (see :class:`PlanCache`: at most ``PlanCache.LIMIT`` entries, the least recently used dropped first), and
:data:`TILED`, the layouts planned by each rank on its own whose chunks rank 0 checked at a commit, and :data:`INFERRED`,
the layouts last inferred for hand-made shards."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

PlanKey = tuple[str, int, int, int, int]
#: (every tensor's metadata on this rank, or ``("layouts", digest)`` for a plan made from compact layouts; the
#: plan; the id of the save it was made for[; (gathered) the ranks holding each of this rank's boxes of the
#: tensors replicated by a sub-mesh alone, ``core.replicas``])
Planned = tuple[Any, ...]


K = TypeVar("K")
V = TypeVar("V")


class PlanCache(Generic[K, V]):
    """A bounded map, the least recently used entry dropped first; the process's two caches are of it. :data:`PLANS`:
    the last tensor layout planned per (``Coordinator.key``, rank, world, alignment, chunk bytes), with this
    rank's tensor metadata and the id of the save it was planned for: a save whose tensors every rank describes
    exactly as then, and for which every rank holds that same plan, reuses it (planning a large model costs tens
    of ms per save).

    Keyed by the gloo group's name, which is new for every group made (after ``release_groups``, a failure, or
    a new process group), so a plan made over one group is never offered over another: a remade group plans
    anew. ("local" is the key of a single process, whose own metadata is all a plan depends on.) At most
    ``LIMIT`` entries (a process rarely saves over more than one or two groups; each plan holds the metadata of
    every tensor of every rank), the least recently used dropped first; ``clear()`` drops all."""

    LIMIT = 8

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: K, entry: V) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def items(self) -> list[tuple[K, V]]:
        """The entries, least recently used first (for tests and diagnostics)."""
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)


#: The process's plan cache.
PLANS: PlanCache[PlanKey, Planned] = PlanCache()


#: (group key, agreed digest) of the plans made on their own whose chunks rank 0 found to tile every tensor
TILED: PlanCache[tuple[str, int], bool] = PlanCache(limit=64)


#: (group key, digest of the tensors as described with their layouts unknown) → the layouts the ranks last agreed on
#: for the tensors whose layout is inferred (``planning.layouts.infer_layout``): a repeated save skips the probe
INFERRED: PlanCache[tuple[str, int], tuple[Any, ...]] = PlanCache(limit=16)


#: (group key, this rank's digest of what it describes) → (the digest of every rank's, the tensors of every stage
#: and their layouts scoped to the ranks holding them): the plan of ranks that hold different tensors
#: (``core.stages``) last agreed on; a repeated save skips the exchange
STAGED: PlanCache[tuple[str, int], tuple[Any, ...]] = PlanCache(limit=16)
