"""What replaying a per-step record costs, as a share of the training time it stands for (``ReplayShare``).

A failure the per-step log covers does not lose the work since the last full checkpoint: it costs the replay of
the records since then (one optimizer step each, plus reading and verifying the record). The share is measured on
the live steps, from the first optimizer step's capture of a record (the copy and checksum a replay reads back,
the step itself, what the loop does before ``maybe_save``) to the record, against the time between two records:
an upper bound of what a replay costs. The manager stretches the memory tier's Young/Daly interval by it
(``policies.AutoInterval.loss``). Pure state, no I/O: the caller passes the clock's readings.
"""

from __future__ import annotations


class ReplayShare:
    """The smoothed share (None before two records with an optimizer step between them)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.value: float | None = None
        self._smoothing = smoothing
        self._first: float | None = None        # the first optimizer step of the record being captured
        self._last: float | None = None         # the last record

    def step(self, now: float) -> None:
        """An optimizer step of the record being captured begins (only the first of a record counts)."""
        if self._first is None:
            self._first = now

    def record(self, now: float) -> None:
        """A record is made at ``now``: one sample, (now − its first step) / (now − the last record)."""
        first, last = self._first, self._last
        self._first, self._last = None, now
        if first is None or last is None or not last < first <= now:
            return                          # (no optimizer step in this record, the first record, a clock oddity)
        sample = (now - first) / (now - last)
        a = self._smoothing
        self.value = sample if self.value is None else (1 - a) * self.value + a * sample


__all__ = ["ReplayShare"]
