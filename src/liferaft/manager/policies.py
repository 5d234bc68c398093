"""When to save and what to keep: pure functions of steps, times and metrics (no I/O, no process group).

``SavePolicy.due`` answers "save at this step?" from the step, the clock and the last save; ``RetentionPolicy.keep``
picks the steps to keep from the committed ones. The manager (``manager.py``) applies them; tests call them
directly.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from liferaft.errors import OptionsError
from liferaft.options import MetricMode

PRIOR_MTBF_HOURS = 24.0        # assumed mean time between failures until restarts say otherwise


def check_int(owner: str, name: str, value: object, minimum: int, optional: bool = False) -> None:
    """OptionsError naming ``owner.name`` unless ``value`` is an ``int`` (not a ``bool``) >= ``minimum`` (or None
    when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise OptionsError(f"{owner}.{name} must be an int >= {minimum}{' or None' if optional else ''}, got "
                           f"{value!r}")


def check_number(owner: str, name: str, value: object, minimum: float, maximum: float = math.inf,
                 optional: bool = False, also: str = "") -> None:
    """OptionsError naming ``owner.name`` unless ``value`` is a finite real number (not a ``bool``) with
    ``minimum < value <= maximum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        minimum < value <= maximum
    if not ok:
        bound = f"> {minimum:g}" + (f" and <= {maximum:g}" if maximum != math.inf else "")
        raise OptionsError(f"{owner}.{name} must be a finite number {bound}{' ' + also if also else ''}"
                           f"{' or None' if optional else ''}, got {value!r}")


def check_steps(owner: str, name: str, value: object) -> frozenset[int]:
    """``value`` (an iterable of ints >= 0, not a string or a mapping) as a frozenset; else OptionsError."""
    bad = OptionsError(f"{owner}.{name} must be an iterable of steps (ints >= 0), got {value!r}")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise bad
    steps = tuple(value)
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps):
        raise bad
    return frozenset(steps)


@dataclass(frozen=True)
class SavePolicy:
    """When the manager saves: policies combined with OR (any one that fires saves), and which saves are full.

    every_steps: save when ``step % every_steps == 0``.
    every_seconds: save when at least this many seconds passed since the last save (or since the start); "auto":
      the Young/Daly interval from the measured save stall and time to durability and the mean time between
      failures (recomputed after every save).
    at_steps: save at exactly these steps (any iterable of ints >= 0, not a string; kept as a frozenset).
    last_step: the final step of the run (saved always; an int >= 0).
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
        check_int("SavePolicy", "every_steps", self.every_steps, 1, optional=True)
        if self.every_seconds != "auto":
            check_number("SavePolicy", "every_seconds", self.every_seconds, 0.0, optional=True, also="or 'auto'")
        object.__setattr__(self, "at_steps", check_steps("SavePolicy", "at_steps", self.at_steps))
        check_int("SavePolicy", "last_step", self.last_step, 0, optional=True)
        check_int("SavePolicy", "full_every", self.full_every, 1)
        check_number("SavePolicy", "mtbf_hours", self.mtbf_hours, 0.0, optional=True)

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
        return "every_seconds" if self.time_due(now, last_save_time, interval_s) else None

    def time_due(self, now: float, last_save_time: float, interval_s: float | None = None) -> bool:
        """Whether the time interval (``every_seconds``, or ``interval_s`` when it is "auto") has elapsed."""
        every = interval_s if self.auto_interval else self.every_seconds
        return isinstance(every, (int, float)) and now - last_save_time >= every


@dataclass(frozen=True)
class RetentionPolicy:
    """Retention policies, combined with OR (a step any of them keeps is kept). With none set, everything is kept.

    keep_last: the newest k committed steps.
    keep_every: steps that are a multiple of n.
    keep_best: the k best steps by ``metric`` (``mode`` "min" or "max"); steps without the metric do not count.
      ``keep_best`` and ``metric`` are given together or not at all.
    Pinned steps and the newest committed step are always kept.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: MetricMode = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            check_int("RetentionPolicy", name, getattr(self, name), 1, optional=True)
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise OptionsError(f"RetentionPolicy.metric must be the name of a metric (a non-empty string), got "
                               f"{self.metric!r}")
        if (self.keep_best is None) != (self.metric is None):
            raise OptionsError("RetentionPolicy.keep_best and metric go together: keep_best=<k> needs "
                               "metric=<name of a metric passed to save/maybe_save>, and metric only serves keep_best")
        if not isinstance(self.mode, str) or self.mode not in ("min", "max"):
            raise OptionsError(f"RetentionPolicy.mode must be 'min' or 'max', got {self.mode!r}")

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
            scored = [(v, s) for s in steps if (m := metrics.get(s)) and (v := _score(m.get(self.metric))) is not None]
            scored.sort(key=lambda x: (x[0] if self.mode == "min" else -x[0], -x[1]))
            kept.update(s for _, s in scored[:self.keep_best])
        return kept


def _score(value: object) -> float | None:
    """A metric to rank by: a finite real number (a bool, NaN, a string or a missing one ranks nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


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
    until it was committed. ``loss``: the share of the time since the last save that a failure costs (1: all of
    it, the work is done again; with the per-step log, the replay of its records: a few percent of it, so the
    saves that protect against the failures the log covers can be rarer: the interval is Young/Daly's for failures
    ``1 / loss`` times rarer, ``loss`` taken in [``MIN_LOSS``, 1]). Pure state, no I/O.
    """

    mtbf_s: float
    stall_s: float = 1.0
    persist_s: float = 0.0
    saves: int = 0
    smoothing: float = 0.5
    loss: float = 1.0

    def record(self, stall_s: float, persist_s: float) -> None:
        a = 1.0 if self.saves == 0 else self.smoothing
        self.stall_s = (1 - a) * self.stall_s + a * max(stall_s, 1e-3)
        self.persist_s = (1 - a) * self.persist_s + a * max(persist_s, 0.0)
        self.saves += 1

    @property
    def interval_s(self) -> float:
        from liferaft.manager.goodput import young_daly

        loss = min(1.0, max(self.loss, MIN_LOSS)) if self.loss == self.loss else 1.0     # (NaN: all of it)
        return max(young_daly(self.stall_s, self.mtbf_s / loss), self.persist_s, 1.0)


class LoopCost:
    """What a save running in the background costs the training loop: the time its steps took beyond a quiet
    step's while it ran (its snapshot's stall included), from the time between ``maybe_save`` calls.

    On a host whose cores all train (CPU training, 2 ranks on 2 cores) the save's encoding, writing and replication
    take the loop's CPU, so a save costs far more than its stall, and Young/Daly's interval taken from the stall
    alone is too short; on a GPU host with idle cores the two agree. ``call(now, busy, other)`` at each
    ``maybe_save`` (``busy``: the save measured was in flight since the previous call, ``stall`` its stall;
    ``other``: another save was, such as the memory tier's: that time is neither quiet nor this save's); an
    interval counts at most ``stall`` plus one quiet step (a save in the background can slow a step, not stop it:
    an evaluation run meanwhile is not its cost); ``started`` when a save begins (what a failed one left is not
    its cost); ``cost(stall, persist)`` once that save committed (the interval in which it is accounted for is then
    not counted: a synchronous save ran in it, whole, as its stall): the lost time summed over its calls, at least
    ``stall`` (noise, or a step made shorter), at most ``stall + persist`` (a save cannot take more of the loop
    than the time it ran). A quiet step is the smoothed time between calls with no save in flight. Pure state, no
    I/O.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self.quiet: float | None = None
        self._smoothing = smoothing
        self._last: float | None = None
        self._lost = 0.0
        self._skip = False

    def started(self) -> None:
        self._lost = 0.0

    def call(self, now: float, busy: bool, other: bool = False, stall: float = 0.0) -> None:
        last, self._last = self._last, now
        skip, self._skip = self._skip, False
        if skip or last is None or now < last or (other and not busy):
            return
        dt = now - last
        if busy:
            if self.quiet is not None:
                self._lost += min(dt - self.quiet, max(stall, 0.0) + self.quiet)
        else:
            a = self._smoothing
            self.quiet = dt if self.quiet is None else (1 - a) * self.quiet + a * dt

    def cost(self, stall_s: float, persist_s: float) -> float:
        """The cost of the save that just committed (and a fresh count for the next)."""
        lost, self._lost, self._skip = self._lost, 0.0, True
        return min(max(lost, stall_s), stall_s + max(persist_s, 0.0))


#: the least share of the work since the last save that ``AutoInterval`` takes a failure to cost (a log's replay
#: measured at less stretches the interval no further: at most sqrt(1 / MIN_LOSS) = 10 times Young/Daly's)
MIN_LOSS = 0.01


_P = TypeVar("_P", SavePolicy, RetentionPolicy)


def with_shorthand(policy: _P, name: str, value: int | None) -> _P:
    """``policy`` with a constructor's shorthand ``name=value`` applied (given once, not twice: OptionsError)."""
    if value is None:
        return policy
    if getattr(policy, name) is not None:
        raise OptionsError(f"{name} is given twice: as {name}={value} and in {type(policy).__name__}; give it once")
    return replace(policy, **{name: value})


def mtbf_from_starts(starts: Sequence[float], prior_s: float, now: float) -> float:
    """Mean time between failures learned from the start times of a job's processes under one root (each start
    after the first is a restart): ``(now − first start) / restarts`` once there are two or more restarts,
    weighted with ``prior_s`` as one pseudo-interval; ``prior_s`` before that."""
    if len(starts) < 3:
        return prior_s
    restarts = len(starts) - 1
    return (now - min(starts) + prior_s) / (restarts + 1)
