"""The per-step log's ring of one rank (docs/STEPLOG.md): which slot each record takes, which records a recovery
may still need, and when a full checkpoint must free the ring. Bookkeeping only — no files, no collectives, no
clock: ``steplog.StepLog`` owns the slot files and the exchanges, and asks it."""

from __future__ import annotations

import itertools

from liferaft.tiers.stepplan import AUTO_MIN


class Ring:
    """One rank's ring of ``size`` slots (None: sized at the first record, ``stepplan.ring_size``, ``AUTO_MIN``
    until then). Counted by steps, not by slots, wherever the ranks must agree (``full``, ``save_due``): every rank
    records the same steps and learns the same durable step, whichever slots each used."""

    def __init__(self, size: int | None) -> None:
        self.size = AUTO_MIN if size is None else size
        self.auto = size is None                    # not yet sized (``StepLog._size_ring``)
        self.held: dict[int, int] = {}              # own slot -> step of the record it holds
        self.durable = -1                           # the newest durable full checkpoint's step (records <= it: free)
        self.busy = -1                              # the own slot the background is reading or writing
        #: the newest step of the records a recovery (or a rollback) listed in this rank's ring: never dropped for
        #: room while newer than the durable step (``free_slot``)
        self.listed: int | None = None
        self.lag: int | None = None                 # records published while the last full checkpoint became durable
        self.lost: int | None = None                # the step of a record that could not be published
        self.recorded: int | None = None            # the step of the last record published

    def _free(self, s: int) -> bool:
        return s != self.busy and (s not in self.held or self.held[s] <= self.durable)

    def free_slot(self) -> tuple[int, int | None]:
        """(slot, dropped step) for the next record: a free slot of the ring (no record, or one at or below the
        durable step), dropped None; while records a recovery listed (up to ``listed``) are still needed, and this
        run's own records newer than the durable step fill fewer than ``size`` slots, the first free slot past
        them (a restart into a smaller ring, or before an auto ring is sized: they are kept until a full
        checkpoint, which ``full`` then asks for); else the oldest record's slot, with the step it held (a full
        ring whose save failed: the caller warns)."""
        for s in range(self.size):
            if self._free(s):
                return s, None
        listed = self.listed if self.listed is not None else -1
        needed = any(self.durable < st <= listed for st in self.held.values())
        ours = sum(st > max(listed, self.durable) for st in self.held.values())
        if needed and ours < self.size:
            return next(s for s in itertools.count(self.size) if self._free(s)), None
        oldest = min(self.held, key=self.held.__getitem__)
        return oldest, self.held[oldest]

    def next_free(self, besides: int) -> int | None:
        """The slot the record after the one in ``besides`` will likely take (its pages reserved ahead)."""
        return next((s for s in range(self.size) if s != besides and self.held.get(s, -1) <= self.durable), None)

    @property
    def full(self) -> bool:
        """Whether every slot holds a record newer than the newest durable full checkpoint."""
        return sum(s > self.durable for s in self.held.values()) >= self.size

    def full_after_next(self, durable: int | None = None) -> bool:
        """Whether the ring is full once one more record is published (the manager votes on it a step ahead),
        counting a full checkpoint of step ``durable`` as durable (a save seen finished, accounted next call)."""
        floor = max(self.durable, -1 if durable is None else durable)
        return sum(s > floor for s in self.held.values()) + 1 >= self.size

    @property
    def save_due(self) -> bool:
        """Whether an asynchronous full checkpoint should start now, so that the ring is freed before it fills:
        the records newer than the newest durable one leave at most ``2 × lag + 3`` slots free (the 3: the vote's
        step, the record it starts at, one spare) — never before half the ring holds such records, and at half
        the ring until a full checkpoint has been measured; at once while a record is missing (``lost``)."""
        if self.lost is not None and self.lost > self.durable:
            return True                     # a record is missing: only a full checkpoint makes later steps count
        newer = sum(s > self.durable for s in self.held.values())
        half = max(1, self.size // 2)
        if self.lag is None:
            return newer >= half
        return newer >= max(half, self.size - (2 * self.lag + 3))

    def mark_durable(self, step: int) -> None:
        """A full checkpoint of ``step`` is durable: records up to it are free. Measures ``lag``."""
        if step > self.durable and self.recorded is not None and self.recorded >= step:
            self.lag = self.recorded - step
        self.durable = max(self.durable, step)

    def past(self, found: list[int], besides: int | None) -> list[int]:
        """Slots past the ring to remove (never ``busy`` nor ``besides``, the record being written): those whose
        record is at or below the durable step, and of ``found`` (slot files seen in the folder; [] to skip) those
        holding no record newer than it (``held``: a recovery's listing). Forgotten here."""
        gone = {s for s, st in self.held.items() if s >= self.size and st <= self.durable}
        gone |= {s for s in found if s >= self.size and self.held.get(s, -1) <= self.durable}
        gone -= {self.busy, besides}
        for s in gone:
            self.held.pop(s, None)
        return sorted(gone)

    def forget_after(self, step: int) -> None:
        """Records newer than ``step`` are gone (a future the resumed run does not share)."""
        for slot, s in list(self.held.items()):
            if s > step:
                del self.held[slot]
        if self.listed is not None and self.listed > step:
            self.listed = step if step > self.durable else None

    def held_steps(self) -> list[int]:
        """Steps of the records a recovery could still need (newer than the durable checkpoint)."""
        return sorted(s for s in self.held.values() if s > self.durable)


__all__ = ["Ring"]
