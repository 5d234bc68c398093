"""Rank 0's view of a manager root between the start and the saves: the start's clean-up, run behind, and the
root's ``INTENT``.

At its start a manager (rank 0, holding the lease) lists the root and removes what interrupted saves left
(``listing.remove_leftovers``). That runs on the manager's deleter thread (``RootStart``), so a restart does not wait
for a listing of the root (a LIST of every key on an object store) before the memory tier answers: the first save,
``steps()`` and ``close()`` wait for it, its warnings are given on the thread that waits, and the first restore uses
its listing while the root is as it was listed. Before a save of a step starts, ``RootStart.begin_save`` refuses it
behind the root's newest step (``rollback``) and records it in the root's ``INTENT`` with the root's epoch (never
lowered within an epoch; the first save of a new epoch records its own): a restore that finds memory holding a step
of the run at least that new lists nothing. A rollback (``go_back``) is recorded in
the root's ``BRANCHES`` before the steps after it are removed.
The manager holds one; it never imports the manager.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor

from liferaft.errors import CorruptCheckpointError
from liferaft.manager.listing import (
    StepInfo,
    list_steps,
    read_branches,
    read_intent_at,
    read_pins,
    remove_leftovers,
    write_branches,
    write_intent,
)
from liferaft.manager.rollback import Branches, check_order, check_pins, forget_after, live
from liferaft.storage import Storage


class RootStart:
    """Rank 0's start of a root: ``begin`` submits the clean-up to ``deleter``. It holds the root's storage only
    (nothing of the manager: a reference back would keep the manager, its gloo groups and their threads alive until
    the interpreter's last collection, where tearing them down aborted the process)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._pass: Future[list[StepInfo] | None] | None = None
        self._warnings: list[str] = []
        self._listing: list[StepInfo] | None = None
        self._changed = False           # a save started: the start's listing is out of date
        self._intent: tuple[int, int | None] | None = None  # INTENT's (step, epoch), once read or written
        self._newest: int | None = None  # the newest committed step a save must not go behind, once known
        self.branches: Branches = ()     # the root's rollbacks (``BRANCHES``), read by ``read_branches``
        self._going_back: int | None = None  # the rollback recorded in BRANCHES whose removal is not done yet

    def _list(self) -> list[StepInfo]:
        """The root's steps (a damaged ``PINS`` does not stop a restore: listed unpinned, with a warning; retention
        and a rollback read it again and refuse to delete)."""
        try:
            pins = read_pins(self.storage)
        except CorruptCheckpointError as e:
            warnings.warn(f"liferaft: {e}; restoring as if no step were pinned", stacklevel=5)
            pins = frozenset()
        return list_steps(self.storage, pins)

    def begin(self, deleter: ThreadPoolExecutor) -> None:
        self._pass = deleter.submit(self._clean_up)

    def _clean_up(self) -> list[StepInfo] | None:
        """Background: list the root and remove what interrupted saves left; the listing, or None if it failed
        (said by a warning: the clean-up runs again at the next start). Its warnings are kept for ``wait``."""
        try:
            listing = self._list()
            remove_leftovers(self.storage, listing, warn=self._warnings.append)
            return listing
        except Exception as e:  # noqa: BLE001 - a clean-up must not stop a job; the restore lists again
            self._warnings.append(f"liferaft: cleaning up {self.storage.url} at the start failed: {e}")
            return None

    def wait(self) -> list[StepInfo] | None:
        """Wait for the clean-up if it still runs and give its warnings (once); its listing while the root is as it
        was listed (no save started since: only this manager writes the root while it holds the lease), else
        None."""
        if self._pass is not None:
            self._listing = self._pass.result()
            self._pass = None
            for text in self._warnings:
                warnings.warn(text, stacklevel=3)
            self._warnings.clear()
        return None if self._changed else self._listing

    def listing(self, intent: int | None) -> list[StepInfo]:
        """The root's steps: as listed at the start while nothing was saved since and no step newer than its newest
        was begun (``intent``: another manager of the job in this process), else listed now."""
        listing = self.wait()
        if listing is not None and (intent is None or
                                    intent <= max((i.step for i in listing if i.status == "committed"), default=-1)):
            return listing
        return self._list()

    def read_branches(self) -> Branches:
        """Read the root's ``BRANCHES`` (at the start: CorruptCheckpointError if damaged); return them."""
        self.branches = read_branches(self.storage)
        return self.branches

    def restored(self, step: int) -> None:
        """A restore loaded ``step``: the newest step saves are ordered against (the newer ones under the root are
        damaged, or the future a rollback leaves)."""
        self._newest = step

    def go_back(self, step: int, listing: list[StepInfo]) -> None:
        """A rollback to ``step`` (a pinned step after it raises first, nothing recorded or removed): recorded in
        ``BRANCHES`` (the new epoch), then the steps after it removed, newest first (``rollback.forget_after``).
        ``INTENT`` is not lowered here: a copy at least that new that a restore finds in memory is taken only if it is
        the run's (``rollback.live``)."""
        self.wait()
        check_pins(listing, step, self.storage.url)
        if self._going_back != step:            # (a retry after a failed removal records no second rollback)
            branches = self.branches + ((len(self.branches) + 1, step),)
            write_branches(self.storage, branches)      # (the lease checked first: ``listing.write_branches``)
            self.branches = branches
            self._going_back = step
        self._changed = True
        forget_after(self.storage, step, listing)
        self._newest = step

    def fork(self, step: int) -> None:
        """A run going on from ``step`` after a restore found nothing newer that loads, though a newer one was begun
        (``INTENT``): a new epoch recorded in ``BRANCHES`` with ``step`` as its branch, nothing removed (the copies
        of newer steps anywhere are the run before's: ``rollback.live``)."""
        self.wait()
        branches = self.branches + ((len(self.branches) + 1, step),)
        write_branches(self.storage, branches)          # (the lease checked first: ``listing.write_branches``)
        self.branches = branches
        self._changed = True

    def gone_back(self) -> None:
        """The rollback ``go_back`` recorded is done on every rank: the next one is another."""
        self._going_back = None

    def live(self, info: StepInfo) -> bool:
        """Whether a listed step belongs to the root's run (``rollback.live``)."""
        return live(info.step, info.epoch, self.branches)

    def begin_save(self, step: int) -> None:
        """Before a save of ``step`` starts (after the lease check): refused when the root holds a newer committed
        step of its run (``rollback.check_order``); then ``step`` recorded in ``INTENT`` (``intend``)."""
        if self._newest is None:
            listing = self.wait()
            self._newest = max((i.step for i in (self._list() if listing is None else listing)
                                if i.status == "committed" and self.live(i)), default=-1)
        check_order(step, self._newest, self.storage.url)
        self.intend(step)
        self._newest = step

    def intend(self, step: int) -> None:
        """Before a save of ``step`` starts (after the lease check): the clean-up done, then ``step`` recorded in the
        root's ``INTENT`` unless it holds a newer one of the root's current epoch (one of another epoch, or of none
        it records, is replaced)."""
        self.wait()
        self._changed = True
        if self._intent is None:
            self._intent = read_intent_at(self.storage)
        epoch = len(self.branches)
        if self._intent is None or step > self._intent[0] or self._intent[1] != epoch:
            write_intent(self.storage, step, epoch)
            self._intent = (step, epoch)
