"""What the ranks of a manager agree on at each ``maybe_save``, as pure functions.

Some reasons to save rest on what each rank sees alone: its clock (a time interval), a signal it received, the
memory tier's time interval, the per-step log's ring as the saves it has seen finish leave it. With several ranks
each rank casts its ``Views`` as a vote (an all-reduce of five integers, maximum) and every rank acts on the
maximum: at a manager's first ``maybe_save`` the vote is reduced at once; later, each call casts its vote at its
end and the next call acts on it (the reduction runs during the step). Step-based reasons (``every_steps``, a
step-based ``memory_every``) are the same on every rank and taken as each rank sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


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


__all__ = ["Views", "agree"]
