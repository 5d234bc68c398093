"""The manager's option objects besides its policies (``policies.py``): the tiers, preemption, the job. Frozen and
validated on construction (``OptionsError`` naming the field); no I/O, no process group."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from liferaft.errors import OptionsError
from liferaft.manager.identity import validate_job_id

if TYPE_CHECKING:
    from liferaft.storage import Storage
    from liferaft.tiers.memory import MemoryTier

DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


def _number(owner: str, name: str, value: object, minimum: float, strict: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value > minimum if strict else value >= minimum)
    if not ok:
        raise OptionsError(f"{owner}.{name} must be a finite number {'>' if strict else '>='} {minimum:g}, "
                           f"got {value!r}")


@dataclass(frozen=True)
class TierOptions:
    """The memory tier, and a remote tier drained from it (docs/TIERS.md).

    memory: a ``MemoryTier``: every ``memory_every`` steps (or "auto": by Young/Daly for the failures memory
      covers) the state is also saved into node-local shared memory with replicas on other nodes (skipped while
      the previous one still runs). ``restore`` loads from memory when it holds a step at least as new as the
      root's newest.
    drain: a save to the root is a memory save drained to the root in the background (the same checkpoint,
      copied from memory, not re-staged; always a full one).
    remote: a third tier (path, URL or ``Storage``): every ``remote_every``-th drained root save is drained there
      too; restored from when neither memory nor the root holds a newer step. Needs ``drain=True``.
    """

    memory: MemoryTier
    memory_every: int | Literal["auto"] = 1
    drain: bool = True
    remote: str | os.PathLike[str] | Storage | None = None
    remote_every: int = 1

    def __post_init__(self) -> None:
        if self.memory is None:
            raise OptionsError("TierOptions.memory: a MemoryTier is required (leave tiers=None for no tiers)")
        if self.memory_every != "auto" and (not isinstance(self.memory_every, int) or isinstance(
                self.memory_every, bool) or self.memory_every < 1):
            raise OptionsError(f"TierOptions.memory_every must be a number of steps >= 1 or 'auto', got "
                               f"{self.memory_every!r}")
        if not isinstance(self.remote_every, int) or self.remote_every < 1:
            raise OptionsError(f"TierOptions.remote_every must be an int >= 1, got {self.remote_every!r}")
        if self.remote is not None and not self.drain:
            raise OptionsError("TierOptions.remote drains from the memory tier: it needs drain=True")


@dataclass(frozen=True)
class PreemptionOptions:
    """What a preemption signal does: the next ``maybe_save`` saves at once, synchronously, with every collective
    wait bounded by ``deadline`` seconds, and sets ``preempted`` (the loop should then stop).

    signals: the signals that mean "preempted" (any iterable; kept as a tuple). Empty: no handlers.
    deadline: seconds any rank waits at any step of the preemption save.
    install: "first_save": the handlers are installed at the first ``maybe_save`` (from the main thread only);
      "explicit": only by ``CheckpointManager.handle_preemption()``. Never at construction; ``close()`` puts the
      previous handlers back.
    """

    signals: tuple[int, ...] = DEFAULT_SIGNALS
    deadline: float = 120.0
    install: Literal["first_save", "explicit"] = "first_save"

    def __post_init__(self) -> None:
        try:
            sigs = tuple(signal.Signals(s) for s in self.signals)
        except (TypeError, ValueError):
            raise OptionsError(f"PreemptionOptions.signals must be signal numbers, got {self.signals!r}") from None
        object.__setattr__(self, "signals", sigs)
        _number("PreemptionOptions", "deadline", self.deadline, 0.0)
        if self.install not in ("first_save", "explicit"):
            raise OptionsError(f"PreemptionOptions.install must be 'first_save' or 'explicit', got {self.install!r}")


@dataclass(frozen=True)
class JobOptions:
    """The job writing the root and its lease (docs/MANAGER.md, "One writer per root").

    job_id: identifies the job across restarts; None: derived by rank 0 from torchrun's run id, Slurm's job and
      step, or the torchrun launch, else a random id per launch (``manager.identity``).
    lease_ttl: seconds after which a lease nobody renewed is stale (renewed every ``lease_ttl / 3`` s).
    """

    job_id: str | None = None
    lease_ttl: float = 30.0

    def __post_init__(self) -> None:
        try:
            validate_job_id(self.job_id)
        except OptionsError as e:
            raise OptionsError(f"JobOptions.{e}") from None
        _number("JobOptions", "lease_ttl", self.lease_ttl, 0.0)


__all__ = ["DEFAULT_SIGNALS", "JobOptions", "PreemptionOptions", "TierOptions"]
