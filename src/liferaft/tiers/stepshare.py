"""What replaying a per-step record costs, as a share of the training time it stands for (``ReplayShare``).

A failure the per-step log covers does not lose the work since the last full checkpoint: it costs the replay of
the records since then (one optimizer step each, plus reading and verifying the record). The share is measured on
the live steps, from the first optimizer step's capture of a record (the copy and checksum a replay reads back,
the step itself, what the loop does before ``maybe_save``) to the record, against the time between two records:
on the CPU about what a replay costs, or more (a review measured 36 ms of window against ~30 ms of replay per
record); on a GPU the host's clock does not see the step's kernels run, so CUDA records give no share. The
manager stretches the memory tier's Young/Daly interval by it (``policies.AutoInterval.loss``), where the log
covers what the memory tier covers. Pure state, no I/O: the caller passes the clock's readings.
"""

from __future__ import annotations


class ReplayShare:
    """The smoothed share: None before two records with an optimizer step between them, and None (the work is
    lost, not replayed) while the chain of records since the last full checkpoint has a hole (``spoil``: a step
    without a record, a record dropped or not published) until a newer full checkpoint is durable (``durable``),
    or once a record held CUDA tensors (``blind``: the host's clock sees the kernels launched, not run, and the
    copies written in the background)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self._value: float | None = None
        self._smoothing = smoothing
        self._first: float | None = None        # the first optimizer step of the record being captured
        self._last: float | None = None         # the last record
        self._spoiled: int | None = None        # the newest step recorded when the chain broke
        self.blind = False

    @property
    def value(self) -> float | None:
        return None if self.blind or self._spoiled is not None else self._value

    def spoil(self, newest: int) -> None:
        """The chain broke with records up to step ``newest`` made: no share until a full checkpoint of at least
        that step is durable."""
        self._spoiled = max(newest, self._spoiled if self._spoiled is not None else newest)

    def durable(self, step: int) -> None:
        if self._spoiled is not None and step >= self._spoiled:
            self._spoiled = None

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
        self._value = sample if self._value is None else (1 - a) * self._value + a * sample


__all__ = ["ReplayShare"]
