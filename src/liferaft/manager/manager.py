"""CheckpointManager: when to save, what to keep, what to resume from — three calls in a training script.

Layout: ``root/step-<step, 10 digits>/`` is one liferaft checkpoint per step (committed when it holds ``COMMIT``),
``root/LEASE`` the lease of the job writing the root, ``root/PINS`` the steps pinned by the user. Rank 0 does
the listing, the lease and the deletions; every other decision is agreed on collectively, so all ranks save the
same steps and restore the same step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Iterable, Mapping

from liferaft.core.load import load
from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.dist import Coordinator
from liferaft.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    IncompleteCheckpointError,
    LiferaftError,
    OptionsError,
    ReadOnlyRootError,
)
from liferaft.format.manifest import COMMIT_MARKER
from liferaft.manager.identity import this_job, validate_job_id
from liferaft.manager.lease import LEASE, Lease
from liferaft.manager.listing import STEP_PREFIX, StepInfo, _foreign_steps, _parse_step, list_steps, step_name  # noqa: F401
from liferaft.manager.policies import AutoInterval, RetentionPolicy, SavePolicy, mtbf_from_starts, referenced_closure
from liferaft.manager.tiering import PRIOR_MTBF_HOURS, TierMixin
from liferaft.options import LoadOptions, LoadResult, SaveOptions
from liferaft.storage import Storage, resolve

_DAMAGE = ("CorruptCheckpointError", "IncompleteCheckpointError")     # load errors that make restore fall back
PINS = "PINS"


class CheckpointManager(TierMixin):
    """Saves a training state under ``root`` by policy, keeps what the retention policy says, restores the newest
    step that loads. Collective: every rank of ``process_group`` constructs it and makes the same calls.

    Save policies (any fires): ``every_steps``, ``every_seconds`` (seconds, or "auto": the Young/Daly interval from
    the measured save stall and time to durability and the mean time between failures, ``mtbf_hours`` or learned
    from the job starts recorded in root/STARTS; recomputed after every save), ``at_steps``, ``last_step`` (always saved), and
    preemption (``preemption_signals``, default SIGTERM and SIGUSR1: the next ``maybe_save`` saves at once,
    synchronously, with every collective wait bounded by ``preemption_deadline`` seconds, and
    sets ``preempted``; the loop should then stop). Retention (any keeps): ``keep_last``, ``keep_every``,
    ``keep_best`` by ``metric`` (``mode`` "min"/"max"), and pinned steps; the newest committed step is always
    kept. Deletion runs in a background thread after a save commits and never touches the newest committed step
    or an unfinished one. ``async_save=True`` returns from ``maybe_save`` once the snapshot is taken.

    Memory tier (``memory=MemoryTier(...)``, docs/TIERS.md): every ``memory_every`` steps the state is also saved
    into node-local shared memory with replicas on other nodes (skipped while the previous one still runs). With
    ``drain=True`` (default) a save to the root is a memory save drained to the root in the background (the same
    checkpoint, copied from memory, not re-staged; a full one). ``restore`` loads from memory when it holds a step
    at least as new as the root's newest, taking files no live node holds from the root's copy of that step.

    Incremental saves (``incremental=True``, the default): each save references the chunks that did not change
    since the previous committed step instead of writing them again; every ``full_every``-th save is a full,
    self-contained one, so that references never reach further back than the last full save. Retention never
    deletes a step that a kept step references (it goes once nothing kept refers to it). A step is referenced only
    for at least ``SaveOptions.reference_min_share`` (10 %) of a save's bytes; fewer unchanged chunks of it are
    copied into the new step, so crumbs never keep an old step beyond ``keep_last``.

    ``job_id`` identifies the job across restarts (default: derived by rank 0 from torchrun's run id, Slurm's job
    and step, or the torchrun launch, else a random id per launch: ``manager.identity``); a root used by another
    job, or by another live process on this host, is refused (CheckpointBusyError, see ``manager.lease``). On
    construction rank 0 takes the lease and removes leftovers of interrupted saves. A root that cannot be written
    (``read_only``) still restores; saving there raises ReadOnlyRootError. A root that is not a directory raises
    StorageError here.
    """

    #: what the last ``restore`` loaded (``LoadResult``: keys missing / unexpected with ``strict=False``, bytes,
    #: timings); None before one, or when it found nothing to restore
    last_load: LoadResult | None = None

    def __init__(self, root: str | os.PathLike[str] | Storage, *, every_steps: int | None = None,
                 every_seconds: float | str | None = None, at_steps: Iterable[int] = (), last_step: int | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, keep_best: int | None = None,
                 metric: str | None = None, mode: str = "min", async_save: bool = True,
                 process_group: Any = None, save_options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None, preemption_signals: Iterable[int] | None = None,
                 preemption_deadline: float = 120.0,
                 job_id: str | None = None, lease_ttl: float = 30.0, incremental: bool = True,
                 full_every: int = 10, memory: Any = None, memory_every: int | str = 1, drain: bool = True,
                 remote: str | os.PathLike[str] | Storage | None = None, remote_every: int = 1,
                 mtbf_hours: float | None = None) -> None:
        if full_every < 1:
            raise OptionsError(f"full_every must be at least 1, got {full_every}")
        self.incremental, self.full_every = incremental, full_every
        self._mem_auto: AutoInterval | None = None
        if memory_every == "auto":          # seconds, by Young/Daly for the failures memory covers
            self._mem_auto = AutoInterval(mtbf_s=(mtbf_hours or PRIOR_MTBF_HOURS) * 3600.0, stall_s=0.1)
        elif isinstance(memory_every, str) or memory_every < 1:
            raise OptionsError(f"memory_every must be a number of steps ≥ 1 or 'auto', got {memory_every!r}")
        self.memory, self.memory_every = memory, memory_every       # a liferaft.tiers.memory.MemoryTier
        self._mem_last = time.monotonic()
        self.drain = drain and memory is not None
        if remote is not None and not self.drain:
            raise OptionsError("remote= drains from the memory tier: it needs memory=MemoryTier(...) and drain=True")
        if remote_every < 1:
            raise OptionsError(f"remote_every must be at least 1, got {remote_every}")
        self.remote = resolve(remote) if remote is not None else None
        self.remote_every, self._drains = remote_every, 0
        self._draining: tuple[int, Mapping[str, float]] | None = None
        self._base: tuple[int, int] | None = None       # (newest committed step, its saves since a full one)
        self._auto: AutoInterval | None = None
        if every_seconds == "auto":
            self._auto = AutoInterval(mtbf_s=(mtbf_hours or PRIOR_MTBF_HOURS) * 3600.0)
            every_seconds = self._auto.interval_s
        elif isinstance(every_seconds, str):
            raise OptionsError(f"every_seconds must be a number of seconds or 'auto', got {every_seconds!r}")
        self._mtbf_given = mtbf_hours is not None
        self.save_policy = SavePolicy(every_steps=every_steps, every_seconds=every_seconds,
                                      at_steps=frozenset(at_steps), last_step=last_step)
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                                         metric=metric, mode=mode)
        self.storage = resolve(root)
        self.async_save = async_save
        self.process_group = process_group
        self.save_options = save_options or SaveOptions()
        self.load_options = load_options or LoadOptions()
        if self.save_options.staging != "blocking":
            raise OptionsError("CheckpointManager takes the snapshot before maybe_save returns; use "
                               "liferaft.async_save directly for overlapped staging")
        self.coord = Coordinator(process_group, self.save_options.timeout)
        self.preempted = False
        self.preemption_deadline = preemption_deadline
        self._signalled = threading.Event()
        self._inflight: tuple[int, AsyncSaveHandle, Mapping[str, float], int] | None = None
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._metrics: dict[int, Mapping[str, float]] = {}
        self._reading: set[int] = set()
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="liferaft-retention") \
            if self.coord.rank == 0 else None
        self._old_handlers: dict[int, Any] = {}
        self._closed = False
        self._stall = 0.0
        explicit = validate_job_id(job_id)
        err: BaseException | None = None
        ident: tuple[str, str] | None = None
        if self.coord.rank == 0:                # rank 0's identity is the job's
            try:
                who = this_job(explicit)
                ident = (who.job_id, who.source)
            except BaseException as e:  # noqa: BLE001 - every rank raises
                err = e
        self.job_id, self.job_source = self.coord.broadcast_from_zero(ident, err, "manager (job id)")
        self._lease = Lease(self.storage, self.job_id, lease_ttl) if self.coord.rank == 0 else None
        started: tuple[list[float], str | None] | None = None
        if self._lease is not None:
            try:
                try:
                    self._lease.acquire()
                except ReadOnlyRootError as e:          # restore only: no lease, no clean-up, no start record
                    started = ([], str(e))
                else:
                    self._cleanup_leftovers()
                    starts = self._record_start() if self._auto is not None or self._mem_auto is not None else []
                    started = (starts, None)
            except BaseException as e:  # noqa: BLE001 - every rank raises
                err = e
        starts, self._read_only_why = self.coord.broadcast_from_zero(started, err, "manager (start)")
        if not self._mtbf_given and (self._auto is not None or self._mem_auto is not None):
            mtbf = mtbf_from_starts(starts or [], PRIOR_MTBF_HOURS * 3600.0, time.time())
            for auto in (self._auto, self._mem_auto):
                if auto is not None:
                    auto.mtbf_s = mtbf
            if self._auto is not None:
                self.save_policy = replace(self.save_policy, every_seconds=self._auto.interval_s)
        sigs = (signal.SIGTERM, signal.SIGUSR1) if preemption_signals is None else tuple(preemption_signals)
        if threading.current_thread() is threading.main_thread():
            for sig in sigs:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    @property
    def read_only(self) -> bool:
        """Whether the root cannot be written (this manager restores and lists steps; saving raises
        ReadOnlyRootError)."""
        return self._read_only_why is not None

    def _check_writable(self) -> None:
        if self._read_only_why is not None:
            raise ReadOnlyRootError(self._read_only_why)

    @property
    def interval_s(self) -> float | None:
        """The current time interval between saves (``every_seconds``; recomputed after each save when "auto")."""
        return self.save_policy.every_seconds

    # ------------------------------------------------------------------ listing

    def _step_storage(self, step: int) -> Storage:
        return self.storage.child(step_name(step))

    def _pins(self) -> frozenset[int]:
        try:
            return frozenset(int(s) for s in json.loads(self.storage.read_all(PINS)))
        except FileNotFoundError:
            return frozenset()
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(f"{self.storage.url}/{PINS}: not a JSON list of steps ({e})") from None

    def _list(self, deep: bool = False) -> list[StepInfo]:
        """Every step under the root, oldest first (this process; no collective)."""
        return list_steps(self.storage, self._pins(), deep)

    def steps(self, verify: bool = False) -> list[StepInfo]:
        """Every step under the root, and in this node's memory tier, with its status and the tiers holding a
        committed copy, oldest first. ``verify`` re-hashes every committed step under the root (reads all its
        data). Not collective: a memory-tier step is listed as this node sees it (its data may be spread over
        the nodes)."""
        out = {i.step: replace(i, tiers=("root",) if i.status == "committed" else ()) for i in self._list(deep=verify)}
        if self.memory is not None:
            for step in self.memory.local_steps():
                info = out.get(step)
                if info is None:
                    out[step] = StepInfo(step, self.memory.step_storage(step).url, "committed", tiers=("memory",))
                else:
                    out[step] = replace(info, status="committed", tiers=info.tiers + ("memory",))
        return [out[s] for s in sorted(out)]

    def _cleanup_leftovers(self) -> None:
        """Rank 0, holding the lease: remove steps of saves that never committed (no job writes them now)."""
        listing = self._list()
        needed = {d for i in listing if i.status == "committed" for d in i.depends_on}
        foreign = _foreign_steps(self.storage.list()) if any(i.status == "incomplete" for i in listing) else {}
        for info in listing:
            if info.status == "incomplete" and info.step in needed:
                warnings.warn(f"liferaft: step {info.step} has no commit marker but committed steps reference its "
                              "chunks; keeping its files", stacklevel=2)
            elif info.status == "incomplete" and info.step in foreign:
                warnings.warn(f"liferaft: {info.path} has no commit marker but holds files liferaft does not write "
                              f"({foreign[info.step]!r}...): not a leftover of an interrupted save; leaving it",
                              stacklevel=2)
            elif info.status == "incomplete":
                self._delete_step(info.step)

    def _delete_step(self, step: int) -> None:
        """Marker first, so that a crash halfway leaves an incomplete step (removed at the next start), never
        a committed step with missing files."""
        prefix = step_name(step) + "/"
        self.storage.delete(prefix + COMMIT_MARKER)
        for name in self.storage.list():
            if name.startswith(prefix):
                self.storage.delete(name)           # (through the root: empty folders go too)

    # ------------------------------------------------------------------ restore

    def restore(self, state: Any, step: int | None = None, strict: bool = True) -> int | None:
        """Load the newest committed step that loads (or ``step``) into ``state``; return its step, or None when
        there is none. A step that fails to load (missing files, bad checksum, damaged manifest) is skipped with a
        warning saying why, and the one before it is tried; a state that does not match raises — unless
        ``strict=False``: then the keys that match are loaded and ``last_load`` (the ``LoadResult``) lists the
        others in ``missing_keys`` / ``unexpected_keys``. (Optimizer state of a parameter that was never stepped,
        and buffers a module does not persist, are no mismatch: see ``liferaft.load``.)"""
        self.last_load = None
        if self._inflight is not None or self._draining is not None:
            try:
                self.wait()                 # a save still in flight commits first, so that restore sees it
            except LiferaftError as e:
                warnings.warn(f"liferaft: the save in flight failed ({e}); restoring from what is committed",
                              stacklevel=2)
        listing: list[StepInfo] | None = None
        err: BaseException | None = None
        if self.coord.rank == 0:
            try:
                listing = self._list()
            except BaseException as e:  # noqa: BLE001
                err = e
        listing = self.coord.broadcast_from_zero(listing, err, "restore (listing)")
        assert listing is not None
        if step is None and self.memory is not None:
            got = self._restore_memory(state, listing, strict)
            if got is not None:
                return got
        if step is None and self.remote is not None:
            newest = max((i.step for i in listing if i.status == "committed"), default=None)
            got = self._restore_remote(state, newer_than=newest, strict=strict)
            if got is not None:
                return got
        if step is not None:
            match = [i for i in listing if i.step == step]
            if not match:
                raise CheckpointNotFoundError(f"{self.storage.url}: there is no step {step}; steps: "
                                              f"{[i.step for i in listing]}")
            if match[0].status != "committed":
                cls = IncompleteCheckpointError if match[0].status == "incomplete" else CorruptCheckpointError
                raise cls(f"{self.storage.url}: step {step} cannot be restored ({match[0].reason})")
            candidates = match
        else:
            for info in reversed(listing):
                if info.status == "corrupt":
                    warnings.warn(f"liferaft: skipping step {info.step} ({info.path}): {info.reason}", stacklevel=2)
            candidates = [i for i in reversed(listing) if i.status == "committed"]
        for i, info in enumerate(candidates):
            err = None
            self._reading.add(info.step)            # retention passes leave it alone meanwhile
            try:
                self.last_load = load(self._step_storage(info.step), state, process_group=self.process_group,
                                      strict=strict, options=self.load_options)
            except LiferaftError as e:
                err = e
            finally:
                self._reading.discard(info.step)
            # agree: fall back only if some rank found damage and no rank failed for another reason
            kinds = self.coord.exchange(type(err).__name__ if err else None, None, "restore (outcome)")
            if err is None and not any(kinds):
                self._last_step = info.step
                self._last_time = time.monotonic()
                self._base = (info.step, info.since_full if info.since_full is not None else self.full_every)
                return info.step
            damaged = any(k in _DAMAGE for k in kinds) and all(k is None or k in _DAMAGE or k == "DistributedError"
                                                               for k in kinds)
            if not damaged or step is not None or i == len(candidates) - 1:
                raise err if err is not None else DistributedError(
                    f"restore of step {info.step} failed on other ranks: {[k for k in kinds if k]}")
            warnings.warn(f"liferaft: step {info.step} ({info.path}) did not load ({type(err).__name__}: {err}); "
                          f"trying step {candidates[i + 1].step}", stacklevel=2)
        return None

    # ------------------------------------------------------------------ saving

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled.set()

    def maybe_save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None,
                   force: bool = False) -> bool:
        """Save ``state`` as ``step`` if a save policy says so (or ``force``, or after a preemption signal);
        return whether a save started. With ``async_save`` it returns once the snapshot is taken (an earlier
        save still in flight is waited for first), else once the step is committed."""
        reason = "force" if force else self.save_policy.due(step, time.monotonic(), self._last_step, self._last_time)
        preempt = self._signalled.is_set()
        mem_due = self._memory_due(step)
        if self.coord.world > 1 and (self.save_policy.every_seconds is not None or self._old_handlers
                                     or self._mem_auto is not None):
            votes = self.coord.exchange((reason, preempt, mem_due), None, "maybe_save (agree)")
            reason = next((r for r, _, _ in votes if r), None)
            preempt = any(p for _, p, _ in votes)
            mem_due = any(m for _, _, m in votes)
        self._settle()
        if preempt:
            reason = reason or "preemption"
        if mem_due and reason is None and not preempt:
            # (skipped on every rank while the previous memory save or a save to the root is still running)
            t0 = time.perf_counter()
            self.memory.save(step, state, options=replace(self.save_options, if_busy="skip"))
            if self._mem_auto is not None:
                self._mem_auto.record(time.perf_counter() - t0, 0.0)
            self._mem_last = time.monotonic()
        if reason is None or (self._last_step == step and not force):
            return False
        if self.drain and not preempt:
            self._drain_save(step, state, metrics, reason)
            return True
        if preempt:
            t0 = time.monotonic()
            self._save(step, state, metrics, reason, wait=True, timeout=self.preemption_deadline)
            self.preempted = True
            spent = time.monotonic() - t0
            if spent > self.preemption_deadline:
                warnings.warn(f"liferaft: the preemption save of step {step} took {spent:.0f} s, more than "
                              f"preemption_deadline={self.preemption_deadline:.0f} s", stacklevel=2)
            return True
        self._save(step, state, metrics, reason, wait=not self.async_save)
        return True

    def save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None) -> None:
        """Save now, whatever the policies say (same waiting rules as ``maybe_save``)."""
        self._settle()
        self._save(step, state, metrics, "explicit", wait=not self.async_save)

    def _begin_save(self) -> None:
        """Wait for the previous save (its error is raised here, as itself) and check the lease, on every rank."""
        self._check_writable()
        self.wait()
        err: BaseException | None = None
        if self._lease is not None:
            try:
                self._lease.check()
            except BaseException as e:  # noqa: BLE001
                err = e
        self.coord.exchange(None, err, "save (lease)")

    def _metadata(self, step: int, reason: str, metrics: Mapping[str, float] | None,
                  since_full: int) -> dict[str, Any]:
        """The manifest ``extra`` of a save by this manager."""
        return {**dict(self.save_options.metadata), "step": step, "reason": reason,
                "metrics": {k: float(v) for k, v in (metrics or {}).items()}, "job_id": self.job_id,
                "since_full": since_full}

    def _save(self, step: int, state: Any, metrics: Mapping[str, float] | None, reason: str, wait: bool,
              timeout: float | None = None) -> None:
        self._begin_save()
        base = self._base if self.incremental and self._base is not None and self._base[0] != step else None
        since = base[1] + 1 if base is not None and base[1] + 1 < self.full_every else 0
        meta = self._metadata(step, reason, metrics, since)
        opts = replace(self.save_options, metadata=meta, overwrite=True,
                       incremental_base=step_name(base[0]) if base is not None and since else None)
        if timeout is not None:                     # a preemption save: no rank waits past the deadline
            opts = replace(opts, timeout=min(opts.timeout, timeout))
        target = self._step_storage(step)
        self._last_step, self._last_time = step, time.monotonic()
        t0 = time.perf_counter()
        if wait:
            res = save(target, state, process_group=self.process_group, options=opts)
            self._stall = time.perf_counter() - t0
            self._committed(step, metrics, since, res)
            return
        handle = async_save(target, state, process_group=self.process_group, options=opts)
        assert handle is not None
        self._stall = time.perf_counter() - t0
        self._inflight = (step, handle, dict(metrics or {}), since)

    def _settle(self) -> None:
        """If the save in flight has finished, account for it (raises its error)."""
        if self._inflight is not None and self._inflight[1].done():
            self.wait()
        if self._draining is not None and not self.memory.busy:
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight (raises what it raised, on every rank)."""
        if self._draining is not None:
            step, metrics = self._draining
            self._draining = None
            self.memory.wait()
            self._committed(step, metrics, 0, None)
        if self._inflight is None:
            return
        step, handle, metrics, since = self._inflight
        self._inflight = None
        res = handle.wait()
        self._committed(step, metrics, since, res)

    def _committed(self, step: int, metrics: Mapping[str, float] | None, since_full: int, result: Any) -> None:
        self._base = (step, since_full)
        if self._auto is not None:
            # per rank (no collective here: ranks see a save finish at different calls); maybe_save agrees on the
            # time policy's decision anyway
            persist = float(result.timings.get("total", self._stall)) if result is not None else self._stall
            self._auto.record(self._stall, persist)
            self.save_policy = replace(self.save_policy, every_seconds=self._auto.interval_s)
        if metrics:
            self._metrics[step] = dict(metrics)
        if self._deleter is not None and self.retention.deletes_anything:
            self._deleter.submit(self._apply_retention)     # one worker: passes run one after the other

    def _apply_retention(self) -> None:
        """Rank 0, background: delete committed steps the retention policy does not keep."""
        try:
            listing = self._list()
            committed = [i.step for i in listing if i.status == "committed"]
            metrics = {i.step: i.metrics for i in listing if i.metrics}
            keep = set(self.retention.keep(committed, {**metrics, **self._metrics}, self._pins()))
            inflight = self._inflight[0] if self._inflight is not None else None
            keep |= {inflight} if inflight is not None else set()
            keep |= set(self._reading)
            keep = referenced_closure(keep, {i.step: i.depends_on for i in listing})
            for s in committed:
                if s not in keep:
                    self._delete_step(s)
        except Exception as e:  # noqa: BLE001 - retention must not stop training; it runs again after the next save
            warnings.warn(f"liferaft: removing old checkpoints under {self.storage.url} failed: {e}", stacklevel=2)

    # ------------------------------------------------------------------ pins, close

    def pin(self, step: int) -> None:
        """Keep ``step`` whatever the retention policy says (recorded under the root; rank 0 writes it)."""
        self._check_writable()
        if self.coord.rank == 0:
            self.storage.put_atomic(PINS, json.dumps(sorted(self._pins() | {step})).encode())

    def unpin(self, step: int) -> None:
        self._check_writable()
        if self.coord.rank == 0:
            self.storage.put_atomic(PINS, json.dumps(sorted(self._pins() - {step})).encode())

    def close(self) -> None:
        """Wait for the save in flight and for deletions, restore signal handlers, release the lease. Collective."""
        if self._closed:
            return
        self._closed = True
        err: BaseException | None = None
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - raised below, after the clean-up
            err = e
        if self.memory is not None:
            try:
                self.memory.wait()
            except BaseException as e:  # noqa: BLE001
                err = err or e
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
        if self._lease is not None:
            self._lease.release()
        if err is not None:
            raise err
        self.coord.exchange(None, None, "manager (close)")   # every rank returns after the deletions

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["CheckpointManager", "StepInfo", "LEASE", "PINS", "step_name", "list_steps"]
