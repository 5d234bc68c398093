"""The parts of CheckpointManager that deal with the memory tier and the automatic interval (docs/TIERS.md):
saving to memory and draining root saves from it, restoring from it, recording job starts. A mixin of
``CheckpointManager``: it uses the manager's attributes and collectives."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from liferaft.errors import LiferaftError
from liferaft.format.layout import COMMIT_MARKER, step_name

if TYPE_CHECKING:
    from liferaft.manager.listing import StepInfo

STARTS = "STARTS"              # start times of the jobs' processes on this root (every_seconds="auto" learns from it)
PRIOR_MTBF_HOURS = 24.0        # assumed mean time between failures until restarts say otherwise


class TierMixin:
    """Memory-tier saves, drains and restores, and the job-start record, for ``CheckpointManager``."""

    @property
    def memory_interval_s(self) -> float | None:
        """With ``memory_every="auto"``: the current time interval between memory-tier saves."""
        return self._mem_auto.interval_s if self._mem_auto is not None else None

    def _record_start(self) -> list[float]:
        """Rank 0, holding the lease: append this start to root/STARTS (the last 100); return them all."""
        starts: list[float] = []
        try:
            starts = [float(x) for x in json.loads(self.storage.read_all(STARTS))][-99:]
        except (FileNotFoundError, ValueError, TypeError):
            starts = []
        starts.append(time.time())
        self.storage.put_atomic(STARTS, json.dumps(starts).encode())
        return starts

    def _restore_memory(self, state: Any, listing: list[StepInfo], strict: bool = True) -> int | None:
        """Load from the memory tier if it holds a step at least as new as the root's newest committed one."""
        newest = max((i.step for i in listing if i.status == "committed"), default=None)
        if self.remote is not None:
            newest = max([s for s in [newest] + self._remote_newest()[:1] if s is not None], default=None)
        try:
            got = self.memory.restore(state, options=self.load_options, strict=strict,
                                      newer_than=None if newest is None else newest - 1,
                                      fallback=self._slower_copy)
        except LiferaftError as e:          # collective: every rank falls back together
            warnings.warn(f"liferaft: the memory tier could not be restored ({type(e).__name__}: {e}); "
                          "restoring from the root", stacklevel=3)
            return None
        if got is not None:
            self.last_load = self.memory.last_load
            self._last_step, self._last_time = got, time.monotonic()
            match = [i for i in listing if i.step == got and i.status == "committed"]
            self._base = (got, match[0].since_full or 0) if match and match[0].since_full is not None else None
        return got

    def _memory_due(self, step: int) -> bool:
        """Whether the memory tier saves at ``step`` (this rank's view; agreed in ``maybe_save``)."""
        if self.memory is None:
            return False
        if self._mem_auto is None:
            return step % int(self.memory_every) == 0
        return time.monotonic() - self._mem_last >= self._mem_auto.interval_s

    def _drain_save(self, step: int, state: Any, metrics: Mapping[str, float] | None, reason: str) -> None:
        """Save into the memory tier and drain that copy to the root in the background."""
        self._begin_save()
        meta = self._metadata(step, reason, metrics, 0)         # drained root steps are full
        self._last_step, self._last_time = step, time.monotonic()
        t0 = time.perf_counter()
        targets = [self._step_storage(step)]
        if self.remote is not None and self._drains % self.remote_every == 0:
            targets.append(self.remote.child(step_name(step)))
        self._drains += 1
        self.memory.save(step, state, options=replace(self.save_options, metadata=meta, if_busy="wait"),
                         drain_to=targets, wait=not self.async_save)
        self._stall = time.perf_counter() - t0
        self._draining = (step, dict(metrics or {}))
        if not self.async_save:
            self.wait()

    def _slower_copy(self, step: int) -> Any:
        """The root's copy of ``step`` if it has a commit there, else the remote tier's (memory restores take files
        no live node holds from it)."""
        st = self._step_storage(step)
        if self.remote is not None and not st.exists(COMMIT_MARKER):
            return self.remote.child(step_name(step))
        return st

    def _remote_newest(self) -> list[int]:
        """Committed steps on the remote tier, newest first (rank 0 lists, every rank gets it)."""
        steps: list[int] | None = None
        err: BaseException | None = None
        if self.coord.rank == 0:
            try:
                names = {n.split("/", 1)[0] for n in self.remote.list() if n.endswith("/" + COMMIT_MARKER)}
                steps = sorted((int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()),
                               reverse=True)
            except BaseException as e:  # noqa: BLE001
                err = e
        return self.coord.broadcast_from_zero(steps, err, "restore (remote listing)") or []

    def _restore_remote(self, state: Any, newer_than: int | None, strict: bool = True) -> int | None:
        """Load the newest committed step of the remote tier newer than ``newer_than`` that loads (damaged ones
        are skipped with a warning, collectively); None if none."""
        from liferaft.core.load import load

        for step in self._remote_newest():
            if newer_than is not None and step <= newer_than:
                return None
            err: BaseException | None = None
            try:
                self.last_load = load(self.remote.child(step_name(step)), state, process_group=self.process_group,
                                      strict=strict, options=self.load_options)
            except LiferaftError as e:
                err = e
            kinds = self.coord.exchange(type(err).__name__ if err else None, None, "restore (remote outcome)")
            if not any(kinds):
                self._last_step, self._last_time, self._base = step, time.monotonic(), None
                return step
            warnings.warn(f"liferaft: step {step} on the remote tier did not load ({kinds}); trying an older one",
                          stacklevel=3)
        return None
