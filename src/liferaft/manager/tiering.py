"""The tiers of a manager besides its root (docs/TIERS.md): the memory tier it saves into between root saves and
drains root saves from, and a remote tier drained from memory too; restoring from the nearest of them.

``Tiers`` is a component the manager holds: it gets the root, the coordinator and the process group at
construction and everything else as arguments, and returns what it did (the manager keeps its own bookkeeping).
It never imports the manager.
"""

from __future__ import annotations

import errno
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from liferaft.core.load import load
from liferaft.dist import Coordinator
from liferaft.errors import CorruptCheckpointError, FileAccessError, IncompleteCheckpointError, LiferaftError
from liferaft.format.layout import COMMIT_MARKER, parse_step, step_name
from liferaft.manager.listing import ROOT_KEY, StepInfo, epoch_of
from liferaft.manager.options import TierOptions
from liferaft.manager.policies import AutoInterval
from liferaft.manager.rollback import forget_after
from liferaft.options import LoadOptions, LoadResult, SaveOptions
from liferaft.storage import Storage, resolve

if TYPE_CHECKING:
    from liferaft.tiers.memory import MemoryTier

_UNREADABLE = "UnreadableFile"      # a step's file the device failed to read (EIO): another copy may read
_DAMAGE = (CorruptCheckpointError.__name__, IncompleteCheckpointError.__name__, _UNREADABLE)   # restore falls back


def _kind(err: LiferaftError | None) -> str | None:
    """How a rank's failure to load a step is told to the others: its error's class, or ``_UNREADABLE`` for an
    I/O error of the device (damage, like a bad checksum; a refused permission or too many open files are not)."""
    if err is None:
        return None
    if isinstance(err, FileAccessError) and err.errno == errno.EIO:
        return _UNREADABLE
    return type(err).__name__


def first_that_loads(coord: Coordinator, candidates: Sequence[tuple[int, str]],
                     load_one: Callable[[int], LoadResult], raise_last: bool) -> tuple[int, LoadResult] | None:
    """Load the first of ``candidates`` ((step, where) newest first) that loads on every rank, by ``load_one``;
    return (step, its LoadResult). Collective: the ranks agree on each outcome, and fall back to the next step
    only if some rank found damage (a corrupt or incomplete checkpoint, a file the device cannot read) and no
    rank failed for another reason
    (a state that does not match raises at once: falling back would hide a bug), with a warning naming the step
    and why. When the last candidate is damaged too: raise its error (``raise_last``) or return None."""
    from liferaft.errors import DistributedError

    for i, (step, where) in enumerate(candidates):
        err: LiferaftError | None = None
        result: LoadResult | None = None
        try:
            result = load_one(step)
        except LiferaftError as e:
            err = e
        kinds = coord.exchange(_kind(err), None, "restore (outcome)")
        if err is None and not any(kinds):
            assert result is not None
            return step, result
        damaged = any(k in _DAMAGE for k in kinds) and all(k is None or k in _DAMAGE or k == "DistributedError"
                                                           for k in kinds)
        last = i == len(candidates) - 1
        if not damaged or (last and raise_last):
            raise err if err is not None else DistributedError(
                f"restore of step {step} failed on other ranks: {[k for k in kinds if k]}")
        why = f"{type(err).__name__}: {err}" if err is not None else f"on other ranks: {[k for k in kinds if k]}"
        then = "" if last else f"; trying step {candidates[i + 1][0]}"
        warnings.warn(f"liferaft: step {step} ({where}) did not load ({why}){then}", stacklevel=3)
    return None


class Tiers:
    """The memory tier (and the remote tier) of one manager. ``root`` is the manager's root, ``coord`` its
    coordinator; ``mtbf_s`` the failure rate ``memory_every="auto"`` assumes."""

    def __init__(self, options: TierOptions, root: Storage, coord: Coordinator, process_group: Any,
                 mtbf_s: float, owner: str) -> None:
        self.memory: MemoryTier = options.memory
        self.memory_every = options.memory_every
        self.drain = options.drain
        self.remote = resolve(options.remote) if options.remote is not None else None
        self.remote_every = options.remote_every
        #: with ``memory_every="auto"``: the Young/Daly interval of memory saves (seconds)
        self.auto = AutoInterval(mtbf_s=mtbf_s, stall_s=0.1) if options.memory_every == "auto" else None
        self._root, self._coord, self._process_group = root, coord, process_group
        #: the root's identity (``listing.ROOT_KEY``): a memory copy another root's manager saved is never restored
        #: (a copy without the key, saved before liferaft recorded it, is taken as the root's own)
        self.owner = owner
        self._last = time.monotonic()
        self._drains = 0

    @property
    def interval_s(self) -> float | None:
        """With ``memory_every="auto"``: the current time interval between memory-tier saves."""
        return self.auto.interval_s if self.auto is not None else None

    @property
    def busy(self) -> bool:
        return self.memory.busy

    def wait(self) -> None:
        """Wait for the memory tier's save in flight (and its drains); raise what it raised, on every rank."""
        self.memory.wait()

    def local_steps(self) -> list[int]:
        """Steps this node's memory tier holds committed (no collective)."""
        return self.memory.local_steps()

    def listed(self, listing: Sequence[StepInfo]) -> list[StepInfo]:
        """The root's ``listing`` with this node's memory-tier steps added (no collective): a committed copy is
        listed with the tiers that hold one ("root", "memory"), oldest first."""
        out = {i.step: replace(i, tiers=("root",) if i.status == "committed" else ()) for i in listing}
        for step in self.local_steps():
            info = out.get(step)
            out[step] = StepInfo(step, self.memory.step_storage(step).url, "committed", tiers=("memory",)) \
                if info is None else replace(info, status="committed", tiers=info.tiers + ("memory",))
        return [out[s] for s in sorted(out)]

    # ------------------------------------------------------------------ saving

    def due(self, step: int) -> bool:
        """Whether the memory tier saves at ``step`` (this rank's view; the manager agrees on it)."""
        if self.auto is None:
            return step % int(self.memory_every) == 0
        return time.monotonic() - self._last >= self.auto.interval_s

    def save(self, step: int, state: Any, options: SaveOptions) -> None:
        """A memory save between root saves (skipped on every rank while the previous one still runs)."""
        t0 = time.perf_counter()
        self.memory.save(step, state, options=replace(options, if_busy="skip"))
        if self.auto is not None:
            self.auto.record(time.perf_counter() - t0, 0.0)
        self._last = time.monotonic()

    def drain_save(self, step: int, state: Any, options: SaveOptions, wait: bool) -> None:
        """Save into the memory tier and drain that copy to the root (and every ``remote_every``-th to the remote
        tier) in the background; ``wait``: return once drained. ``options.metadata`` is the step's."""
        targets = [self._root.child(step_name(step))]
        if self.remote is not None and self._drains % self.remote_every == 0:
            targets.append(self.remote.child(step_name(step)))
        self._drains += 1
        self.memory.save(step, state, options=replace(options, if_busy="wait"), drain_to=targets, wait=wait)

    def forget_after(self, step: int, on_zero: bool) -> None:
        """A rollback: remove the steps newer than ``step`` from this node's memory tier, and (``on_zero``: rank 0)
        from the remote tier. Every rank calls it."""
        self.memory.forget_after(step)
        if on_zero and self.remote is not None:
            forget_after(self.remote, step, self._remote_listing())

    # ------------------------------------------------------------------ restoring

    def restore(self, state: Any, intent: int | None, root_newest: Callable[[], int | None],
                load_options: LoadOptions, strict: bool,
                live: Callable[[int, int], bool] = lambda s, e: True) -> tuple[int, LoadResult] | None:
        """Load the newest step the tiers hold that is at least as new as the root's newest committed one: from
        memory (files no live node holds taken from the root's or the remote's copy of the same save), else —
        newer than the root's — from the remote tier. None if the tiers hold none. Collective.

        The memory tier answers first: when its newest complete step is at least ``intent`` (the root's
        ``INTENT``: the newest step a manager of this root began to save to the root or drain to the remote tier),
        it is loaded and neither the root nor the remote tier is listed. Otherwise (no intent recorded, or memory
        holds nothing that new) ``root_newest()`` (collective: the root's newest committed step) and the remote
        tier are listed first, as they must be. ``live(step, epoch)``: whether a copy belongs to the root's run
        (``rollback.live``); a copy of a step a rollback abandoned is never taken, from any tier."""
        self._live = live
        failed = False
        if intent is not None:
            got, failed = self._from_memory(state, intent, load_options, strict)
            if got is not None:
                return got
        newest_root = root_newest()
        remote = self._remote_steps() if self.remote is not None else []
        newest = max([s for s in [newest_root] + remote[:1] if s is not None], default=None)
        if not failed:
            got, _ = self._from_memory(state, newest, load_options, strict)
            if got is not None:
                return got
        newer = [s for s in remote if newest_root is None or s > newest_root]
        if not newer:
            return None
        assert self.remote is not None
        remote_root = self.remote

        def load_one(step: int) -> LoadResult:
            return load(remote_root.child(step_name(step)), state, process_group=self._process_group,
                        strict=strict, options=load_options)

        return first_that_loads(self._coord, [(s, f"{remote_root.url}/{step_name(s)}") for s in newer], load_one,
                                raise_last=False)

    def _from_memory(self, state: Any, at_least: int | None, load_options: LoadOptions,
                     strict: bool) -> tuple[tuple[int, LoadResult] | None, bool]:
        """(the memory tier's newest complete step at least ``at_least``, loaded, or None; whether it failed).
        Collective: a failure is every rank's (they all fall back together)."""
        try:
            step = self.memory.restore(state, options=load_options, strict=strict,
                                       newer_than=None if at_least is None else at_least - 1,
                                       fallback=self._slower_copy, accept=lambda s, x: self._live(s, epoch_of(x))
                                       and x.get(ROOT_KEY, self.owner) == self.owner)
        except LiferaftError as e:
            warnings.warn(f"liferaft: the memory tier could not be restored ({type(e).__name__}: {e}); "
                          "restoring from the root", stacklevel=4)
            return None, True
        return (None if step is None else (step, self.memory.last_load)), False

    def _slower_copy(self, step: int) -> Storage:
        """The root's copy of ``step`` if it has a commit there, else the remote tier's (memory restores take files
        no live node holds from it)."""
        st = self._root.child(step_name(step))
        if self.remote is not None and not st.exists(COMMIT_MARKER):
            return self.remote.child(step_name(step))
        return st

    def _remote_steps(self) -> list[int]:
        """Committed steps on the remote tier, newest first (rank 0 lists, every rank gets it)."""
        remote = self.remote
        assert remote is not None

        def listing() -> list[int]:
            return [i.step for i in sorted(self._remote_listing(), key=lambda i: i.step, reverse=True)
                    if i.status == "committed" and self._live(i.step, _epoch_there(remote, i.step))]

        return self._coord.run_on_zero(listing, "restore (remote listing)")

    _live: Callable[[int, int], bool] = staticmethod(lambda s, e: True)     # (set by each restore)

    def _remote_listing(self) -> list[StepInfo]:
        """Every step folder on the remote tier: committed when it holds a commit marker (rank 0)."""
        assert self.remote is not None
        names = self.remote.list()
        done = {n.split("/", 1)[0] for n in names if n.endswith("/" + COMMIT_MARKER)}
        steps = {s: n.split("/", 1)[0] for n in names if (s := parse_step(n)) is not None}
        return [StepInfo(s, f"{self.remote.url}/{d}", "committed" if d in done else "incomplete")
                for s, d in sorted(steps.items())]


def _epoch_there(storage: Storage, step: int) -> int:
    """The epoch the manifest of ``step`` on ``storage`` records (0 if it records none or cannot be read: then its
    load fails and the restore falls back anyway)."""
    from liferaft.core.commit import open_checkpoint

    try:
        return epoch_of(open_checkpoint(storage.child(step_name(step))).extra)
    except (LiferaftError, OSError):
        return 0
