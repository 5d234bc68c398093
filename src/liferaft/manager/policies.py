"""When to save and what to keep: pure functions of steps, times and metrics (no I/O, no process group).

``SavePolicy.due`` answers "save at this step?" from the step, the clock and the last save; ``RetentionPolicy.keep``
picks the steps to keep from the committed ones. The manager (``manager.py``) applies them; tests call them
directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from liferaft.errors import OptionsError
from liferaft.options import MetricMode

PRIOR_MTBF_HOURS = 24.0        # assumed mean time between failures until restarts say otherwise


@dataclass(frozen=True)
class SavePolicy:
    """When the manager saves: policies combined with OR (any one that fires saves), and which saves are full.

    every_steps: save when ``step % every_steps == 0``.
    every_seconds: save when at least this many seconds passed since the last save (or since the start); "auto":
      the Young/Daly interval from the measured save stall and time to durability and the mean time between
      failures (recomputed after every save).
    at_steps: save at exactly these steps (any iterable of ints; kept as a frozenset).
    last_step: the final step of the run (saved always).
    full_every: every ``full_every``-th save is full (self-contained); the others reference the chunks that did
      not change since the previous committed step (incremental saves). 1: every save is full.
    mtbf_hours: the mean time between failures that ``every_seconds="auto"`` (and the memory tier's
      ``memory_every="auto"``) assume; None: learned from the job starts recorded under the root (24 h prior).
    """

    every_steps: int | None = None
    every_seconds: float | Literal["auto"] | None = None
    at_steps: frozenset[int] = field(default_factory=frozenset)
    last_step: int | None = None
    full_every: int = 10
    mtbf_hours: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise OptionsError(f"SavePolicy.every_steps must be an int >= 1, got {self.every_steps!r}")
        if isinstance(self.every_seconds, str):
            if self.every_seconds != "auto":
                raise OptionsError(f"SavePolicy.every_seconds must be a number of seconds or 'auto', got "
                                   f"{self.every_seconds!r}")
        elif self.every_seconds is not None and not self.every_seconds > 0:
            raise OptionsError(f"SavePolicy.every_seconds must be > 0, got {self.every_seconds}")
        try:
            object.__setattr__(self, "at_steps", frozenset(int(s) for s in self.at_steps))
        except (TypeError, ValueError):
            raise OptionsError(f"SavePolicy.at_steps must be steps (ints), got {self.at_steps!r}") from None
        if not isinstance(self.full_every, int) or self.full_every < 1:
            raise OptionsError(f"SavePolicy.full_every must be an int >= 1, got {self.full_every!r}")
        if self.mtbf_hours is not None and not (self.mtbf_hours > 0 and math.isfinite(self.mtbf_hours)):
            raise OptionsError(f"SavePolicy.mtbf_hours must be a finite number of hours > 0, got {self.mtbf_hours}")

    @property
    def auto_interval(self) -> bool:
        """Whether ``every_seconds`` is "auto"."""
        return self.every_seconds == "auto"

    def due(self, step: int, now: float, last_save_step: int | None, last_save_time: float,
            interval_s: float | None = None) -> str | None:
        """The reason to save at ``step`` ("every_steps", "every_seconds", "at_steps", "last_step"), or None.
        Never twice for the same step. ``interval_s``: the time interval in force when ``every_seconds`` is
        "auto" (the caller measures it; without it the time policy does not fire)."""
        if last_save_step == step:
            return None
        if self.last_step is not None and step == self.last_step:
            return "last_step"
        if step in self.at_steps:
            return "at_steps"
        if self.every_steps is not None and step % self.every_steps == 0:
            return "every_steps"
        every = interval_s if self.auto_interval else self.every_seconds
        if isinstance(every, (int, float)) and now - last_save_time >= every:
            return "every_seconds"
        return None


@dataclass(frozen=True)
class RetentionPolicy:
    """Retention policies, combined with OR (a step any of them keeps is kept). With none set, everything is kept.

    keep_last: the newest k committed steps.
    keep_every: steps that are a multiple of n.
    keep_best: the k best steps by ``metric`` (``mode`` "min" or "max"); steps without the metric do not count.
    Pinned steps and the newest committed step are always kept.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: MetricMode = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise OptionsError(f"{name} must be an int >= 1, got {v!r}")
        if self.keep_best is not None and not self.metric:
            raise OptionsError("keep_best needs metric=<name of a metric passed to save/maybe_save>")
        if self.mode not in ("min", "max"):
            raise OptionsError(f"mode must be 'min' or 'max', got {self.mode!r}")

    @property
    def deletes_anything(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    def keep(self, committed: Sequence[int], metrics: Mapping[int, Mapping[str, float]],
             pinned: frozenset[int] = frozenset()) -> set[int]:
        """The committed steps to keep (a subset of ``committed``)."""
        steps = sorted(set(committed))
        if not self.deletes_anything:
            return set(steps)
        kept = set(pinned) & set(steps)
        if steps:
            kept.add(steps[-1])
        if self.keep_last is not None:
            kept.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            kept.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None and self.metric:
            scored = [(m[self.metric], s) for s in steps if (m := metrics.get(s)) and self.metric in m]
            scored.sort(key=lambda x: (x[0] if self.mode == "min" else -x[0], -x[1]))
            kept.update(s for _, s in scored[:self.keep_best])
        return kept


def referenced_closure(keep: Iterable[int], depends_on: Mapping[int, Iterable[int]]) -> set[int]:
    """``keep`` and every step a kept step references, transitively (pure)."""
    out, todo = set(keep), list(keep)
    while todo:
        for d in depends_on.get(todo.pop(), ()):
            if d not in out:
                out.add(d)
                todo.append(d)
    return out


@dataclass
class AutoInterval:
    """``every_seconds="auto"``: the save interval from measured costs and a failure rate, by Young/Daly
    (``planning.goodput.young_daly``), never shorter than the time a save takes to become durable.

    ``mtbf_s``: the mean time between failures (given, or learned from restarts, ``mtbf_from_starts``). Costs are
    smoothed over saves (``record``): ``stall_s`` is what a save cost the training loop, ``persist_s`` the time
    until it was committed. Pure state, no I/O.
    """

    mtbf_s: float
    stall_s: float = 1.0
    persist_s: float = 0.0
    saves: int = 0
    smoothing: float = 0.5

    def record(self, stall_s: float, persist_s: float) -> None:
        a = 1.0 if self.saves == 0 else self.smoothing
        self.stall_s = (1 - a) * self.stall_s + a * max(stall_s, 1e-3)
        self.persist_s = (1 - a) * self.persist_s + a * max(persist_s, 0.0)
        self.saves += 1

    @property
    def interval_s(self) -> float:
        from liferaft.manager.goodput import young_daly

        return max(young_daly(self.stall_s, self.mtbf_s), self.persist_s, 1.0)


def mtbf_from_starts(starts: Sequence[float], prior_s: float, now: float) -> float:
    """Mean time between failures learned from the start times of a job's processes under one root (each start
    after the first is a restart): ``(now − first start) / restarts`` once there are two or more restarts,
    weighted with ``prior_s`` as one pseudo-interval; ``prior_s`` before that."""
    if len(starts) < 3:
        return prior_s
    restarts = len(starts) - 1
    return (now - min(starts) + prior_s) / (restarts + 1)
