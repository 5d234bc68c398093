"""What the ranks of a manager agree on at each ``maybe_save``, as pure functions.

Some reasons to save rest on what each rank sees alone: its clock (a time interval), a signal it received, the
memory tier's time interval, the per-step log's ring as the saves it has seen finish leave it. With several ranks
each rank casts its ``Views`` as a vote (an all-reduce of five integers, maximum) and every rank acts on the
maximum: at a manager's first ``maybe_save`` the vote is reduced at once; later, each call casts its vote at its
end and the next call acts on it (the reduction runs during the step). Step-based reasons (``every_steps``, a
step-based ``memory_every``) are the same on every rank and taken as each rank sees them. ``Ballot`` keeps that
protocol across the calls: one vote taken and one cast per call on every rank, whatever raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from liferaft.errors import LiferaftError

if TYPE_CHECKING:
    from liferaft.dist import Coordinator, MaxVote

_WHAT = "maybe_save (agree)"


class Views(NamedTuple):
    """One rank's view, or the ranks' maximum of them: the time interval elapsed, a preemption signal seen, the
    memory tier's save due, the per-step log's ring full, a full save due to free that ring (none in flight)."""

    time: bool = False
    preempt: bool = False
    memory: bool = False
    log_full: bool = False
    log_half: bool = False

    def ints(self) -> list[int]:
        """The vote: five integers (0 or 1), in field order."""
        return [int(v) for v in self]

    @classmethod
    def of(cls, values: Sequence[int]) -> Views:
        """The views of a reduced vote (``ints`` of one rank, element-wise maximum over the ranks)."""
        if len(values) != len(cls._fields):
            raise ValueError(f"a vote has {len(cls._fields)} values, got {len(values)}")
        return cls(*(bool(v) for v in values))


def agree(reason: str | None, local: Views, voted: Views, auto_memory: bool) -> tuple[str | None, Views]:
    """What every rank acts on: the step-based ``reason`` this rank found (``every_seconds``, this rank's clock, is
    dropped: only the vote decides it), else "every_seconds" when any rank voted for it; the preemption signal and
    the ring as voted; the memory tier's save as voted when its interval is a time ("auto", ``auto_memory``), else
    as this rank sees it (a step count, the same on every rank)."""
    if reason == "every_seconds":
        reason = None
    reason = reason or ("every_seconds" if voted.time else None)
    return reason, voted._replace(memory=voted.memory if auto_memory else local.memory)


class Ballot:
    """The ranks' votes across ``maybe_save`` calls (collective on ``coord``'s group). Each call ``begin``s, then
    ``take``s the vote the previous call cast (the first call's is reduced at once from its own views), then
    ``cast``s its own for the next call; a call that raises anywhere in between ends with ``on_error``, which
    takes and casts what the call had not, so every rank makes the same collectives in the same order."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._pending: MaxVote | None = None    # cast at the end of the last call, under way
        self._prev: MaxVote | None = None       # the one this call takes
        self._taken = True

    def begin(self) -> None:
        """A call begins: the vote cast at the end of the last one is this call's to take."""
        self._prev, self._pending, self._taken = self._pending, None, False

    def take(self, local: Views) -> Views:
        """The ranks' maximum of the votes cast at the end of the last call (at the first: of ``local``, now)."""
        prev, self._prev, self._taken = self._prev, None, True
        return Views.of(prev.result() if prev is not None else self.coord.all_max(local.ints(), _WHAT))

    def cast(self, views: Views) -> None:
        """Cast this call's vote for the next one (the reduction runs until the next call takes it)."""
        self._pending = self.coord.all_max_start(views.ints(), _WHAT)

    def on_error(self, views: Callable[[], Views]) -> None:
        """The call raised before it cast: take the vote if it had not (an empty view at a first call) and cast
        ``views()``; a failure of these collectives is left to the next call (the call's own error is raised)."""
        with contextlib.suppress(LiferaftError):
            if not self._taken:
                self.take(Views())
            self.cast(views())

    def last(self) -> Views | None:
        """The vote the last call cast (reduced now; None if none is under way): at ``close``."""
        pending, self._pending = self._pending, None
        return Views.of(pending.result()) if pending is not None else None


__all__ = ["Ballot", "Views", "agree"]
