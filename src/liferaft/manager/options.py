"""The manager's option objects besides its policies (``policies.py``): the tiers, preemption, the job. Frozen and
validated on construction (``OptionsError`` naming the field); no I/O, no process group."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from liferaft.errors import OptionsError
from liferaft.manager.identity import validate_job_id
from liferaft.manager.policies import check_int, check_number

if TYPE_CHECKING:
    from liferaft.storage import Storage
    from liferaft.tiers.memory import MemoryTier

def check_kinds(owner: str, **given: tuple[object, type]) -> None:
    """Each option ``name=(value, kind)`` of ``owner`` is a ``kind`` or None (OptionsError naming it)."""
    for name, (value, kind) in given.items():
        if value is not None and not isinstance(value, kind):
            raise OptionsError(f"{owner}({name}=...) must be a {kind.__name__} (or None), got {type(value).__name__}")


DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


#: the signals a handler can be installed for (SIGKILL and SIGSTOP cannot be caught)
CATCHABLE_SIGNALS: frozenset[int] = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}

MIN_LEASE_TTL = 1.0             # seconds; renewed every ttl / 3
MAX_LEASE_TTL = 86400.0         # one day


@dataclass(frozen=True)
class TierOptions:
    """The memory tier, and a remote tier drained from it (docs/TIERS.md).

    memory: a ``MemoryTier``: every ``memory_every`` steps (or "auto": by Young/Daly for the failures memory
      covers; with a ``step_log`` that covers them as well, up to 10× rarer: such a failure then costs the
      records' replay, docs/TIERS.md) the state is also saved into node-local shared memory with replicas on
      other nodes (skipped while the previous one still runs). ``restore`` loads from memory when it holds a
      step at least as new as the root's newest.
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
        from liferaft.storage import Storage
        from liferaft.tiers.memory import MemoryTier

        if self.memory_every != "auto":
            check_int("TierOptions", "memory_every", self.memory_every, 1)
        if not isinstance(self.drain, bool):
            raise OptionsError(f"TierOptions.drain must be True or False, got {self.drain!r}")
        if self.remote is not None and not isinstance(self.remote, (str, os.PathLike, Storage)):
            raise OptionsError(f"TierOptions.remote must be a path, a URL or a Storage (or None), got "
                               f"{self.remote!r}")
        check_int("TierOptions", "remote_every", self.remote_every, 1)
        if self.remote is not None and not self.drain:
            raise OptionsError("TierOptions.remote drains from the memory tier: it needs drain=True")
        if self.memory is None:
            raise OptionsError("TierOptions.memory: a MemoryTier is required (leave tiers=None for no tiers)")
        if not isinstance(self.memory, MemoryTier):
            raise OptionsError(f"TierOptions.memory must be a MemoryTier, got {type(self.memory).__name__}")


@dataclass(frozen=True)
class StepLogOptions:
    """The per-step log (docs/STEPLOG.md): every optimizer step recoverable between full checkpoints. Needs
    ``TierOptions`` with a memory tier (the records live in its node-local shared memory).

    replicas: copies of each rank's records on ranks of other nodes (0: none; a lost node then loses its records
      and recovery resumes from the full checkpoint).
    max_steps: records each rank's ring holds (its memory: about ``max_steps`` × (the rank's gradient bytes +
      the rest of the state), × (1 + replicas) per node). When it is filling (about half of them hold records
      newer than the newest durable full checkpoint), ``maybe_save`` starts a full checkpoint (asynchronously
      with ``async_save``): the ring is reused from then on and a recovery replays fewer records. If it fills all
      the same (a save still in flight), ``maybe_save`` takes one at once, synchronously. ``"auto"`` (default):
      sized at the first record from its length, as many as fit in a quarter of the node's shared memory with the
      node's other ranks and the replicas this rank keeps, 4 to 256 (``tiers.stepplan.ring_size``; a warning
      where 4 do not fit). An integer (at least 2): that many, whatever they take.
    """

    replicas: int = 1
    max_steps: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        check_int("StepLogOptions", "replicas", self.replicas, 0)
        m = self.max_steps
        if not (isinstance(m, str) and m == "auto") and (not isinstance(m, int) or isinstance(m, bool) or m < 2):
            raise OptionsError(f"StepLogOptions.max_steps must be 'auto' or an int >= 2, got {m!r}")


@dataclass(frozen=True)
class PreemptionOptions:
    """What a preemption signal does: the next ``maybe_save`` saves at once, synchronously, with every collective
    wait bounded by ``deadline`` seconds, and sets ``preempted`` (the loop should then stop).

    signals: the signals that mean "preempted" (any iterable of catchable signals, not SIGKILL or SIGSTOP; kept as
      a tuple without repeats). Empty: no handlers.
    deadline: seconds any rank waits at any step of the preemption save.
    install: "first_save": the handlers are installed at the first ``maybe_save`` (from the main thread only);
      "explicit": only by ``CheckpointManager.handle_preemption()``. Never at construction; ``close()`` puts the
      previous handlers back.
    """

    signals: tuple[int, ...] = DEFAULT_SIGNALS
    deadline: float = 120.0
    install: Literal["first_save", "explicit"] = "first_save"

    def __post_init__(self) -> None:
        bad = OptionsError(f"PreemptionOptions.signals must be an iterable of catchable signal numbers (not "
                           f"SIGKILL or SIGSTOP), got {self.signals!r}")
        if isinstance(self.signals, (str, bytes, Mapping)) or not isinstance(self.signals, Iterable):
            raise bad
        sigs = tuple(self.signals)
        if any(not isinstance(s, int) or isinstance(s, bool) or s not in CATCHABLE_SIGNALS for s in sigs):
            raise bad
        object.__setattr__(self, "signals", tuple(dict.fromkeys(signal.Signals(s) for s in sigs)))
        check_number("PreemptionOptions", "deadline", self.deadline, 0.0)
        if not isinstance(self.install, str) or self.install not in ("first_save", "explicit"):
            raise OptionsError(f"PreemptionOptions.install must be 'first_save' or 'explicit', got {self.install!r}")


@dataclass(frozen=True)
class JobOptions:
    """The job writing the root and its lease (docs/MANAGER.md, "One writer per root").

    job_id: identifies the job across restarts; None: derived by rank 0 from torchrun's run id, Slurm's job and
      step, or the torchrun launch, else a random id per launch (``manager.identity``).
    lease_ttl: seconds after which a lease nobody renewed is stale (renewed every ``lease_ttl / 3`` s); from 1 s to
      one day.
    """

    job_id: str | None = None
    lease_ttl: float = 30.0

    def __post_init__(self) -> None:
        try:
            validate_job_id(self.job_id)
        except OptionsError as e:
            raise OptionsError(f"JobOptions.{e}") from None
        if not isinstance(self.lease_ttl, (int, float)) or isinstance(self.lease_ttl, bool) or \
                not MIN_LEASE_TTL <= self.lease_ttl <= MAX_LEASE_TTL:
            raise OptionsError(f"JobOptions.lease_ttl must be a number of seconds from {MIN_LEASE_TTL:g} to "
                               f"{MAX_LEASE_TTL:g} (one day), got {self.lease_ttl!r}")


__all__ = ["CATCHABLE_SIGNALS", "DEFAULT_SIGNALS", "JobOptions", "PreemptionOptions", "StepLogOptions", "TierOptions"]
