"""CheckpointManager: when to save, what to keep, what to resume from — three calls in a training script.

Layout: ``root/step-<step, 10 digits>/`` is one liferaft checkpoint per step (committed when it holds ``COMMIT``),
``root/LEASE`` the lease of the job writing the root, ``root/PINS`` the steps pinned by the user. Rank 0 does
the listing, the lease and the deletions; every other decision is agreed on collectively, so all ranks save the
same steps and restore the same step. The options are grouped in frozen objects: ``SavePolicy`` and
``RetentionPolicy`` (``policies.py``), ``TierOptions``, ``PreemptionOptions``, ``JobOptions`` (``options.py``);
the memory and remote tiers are a component of their own (``tiering.Tiers``).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Self

from liferaft.core.load import load
from liferaft.dist import Coordinator
from liferaft.errors import DistributedError, LiferaftError, OptionsError, ReadOnlyRootError
from liferaft.manager.identity import this_job
from liferaft.manager.inflight import Finished, SavesInFlight
from liferaft.manager.lease import LEASE, Lease, record_start
from liferaft.manager.listing import (  # noqa: F401 - PINS, _parse_step: re-exported for tools.steps
    EPOCH_KEY,
    PINS,
    ROOT_KEY,
    StepInfo,
    _parse_step,
    apply_retention,
    list_steps,
    lossy_state_of,
    read_intent_at,
    read_pins,
    restore_candidates,
    step_name,
    write_pins,
)
from liferaft.manager.options import JobOptions, PreemptionOptions, StepLogOptions, TierOptions, check_kinds
from liferaft.manager.policies import (
    PRIOR_MTBF_HOURS,
    AutoInterval,
    LoopCost,
    RetentionPolicy,
    SavePolicy,
    mtbf_from_starts,
    with_shorthand,
)
from liferaft.manager.preemption import Preemption
from liferaft.manager.rollback import Branches, check_pins, check_step, live, pinned_after
from liferaft.manager.startup import RootStart
from liferaft.manager.tiering import Tiers, first_that_loads
from liferaft.manager.voting import Ballot, Views, agree
from liferaft.options import LoadOptions, LoadResult, SaveOptions, check_path
from liferaft.storage import Storage, resolve
from liferaft.tiers.stepcheck import owner_id
from liferaft.tiers.steplog import StepLog


def _note_record(e: BaseException, failed: Exception | None, step: int) -> None:
    """Name the per-step record's error held by ``maybe_save`` (``failed``) on the error ``e`` raised instead."""
    if failed is not None:
        e.add_note(f"liferaft: the per-step record of step {step} had failed on this rank too: {failed!r}")


def _run_all(calls: list[Callable[[], object] | None]) -> BaseException | None:
    """Run every call of ``calls`` (None: none) whatever the others raise; return the first error."""
    err: BaseException | None = None
    for call in calls:
        try:
            if call is not None:
                call()
        except BaseException as e:  # noqa: BLE001 - the caller raises it once every call has run
            err = err or e
    return err


class CheckpointManager:
    """Saves a training state under ``root`` by policy, keeps what the retention policy says, restores the newest
    step that loads. Collective: every rank of ``process_group`` constructs it and makes the same calls.

    ``every_steps``, ``keep_last`` and ``async_save`` are the knobs nearly every script sets: shorthands for
    ``SavePolicy(every_steps=...)`` and ``RetentionPolicy(keep_last=...)`` (given in both places: OptionsError),
    and whether ``maybe_save`` returns once the snapshot is taken (True) or once the step is committed. The rest
    comes in option objects: ``save_policy`` (when to save; which saves are full), ``retention`` (what to keep;
    deleted in a background thread, never the newest committed step, an unfinished one or one a kept step
    references), ``tiers`` (memory and remote tiers, docs/TIERS.md), ``preemption`` (the signals after which the
    next ``maybe_save`` saves at once and sets ``preempted``; handlers installed at the first ``maybe_save`` or by
    ``handle_preemption()``, never here), ``job`` (job id, lease ttl: a root another job or another live process
    on this host writes is refused with CheckpointBusyError), ``save_options`` / ``load_options``.

    On construction rank 0 takes the lease and removes leftovers of interrupted saves. A root that cannot be
    written (``read_only``) still restores; saving there raises ReadOnlyRootError. A root that is not a directory
    raises StorageError here. docs/MANAGER.md has the details.
    """

    #: what the last ``restore`` loaded (``LoadResult``: keys missing / unexpected with ``strict=False``, bytes,
    #: timings); None before one, or when it found nothing to restore
    last_load: LoadResult | None = None
    #: the live state is an approximation since (``mark_lossy``): recorded in every later save as ``lossy_state``
    lossy_state: str | None = None

    def __init__(self, root: str | os.PathLike[str] | Storage, *, every_steps: int | None = None,
                 keep_last: int | None = None, async_save: bool = True, save_policy: SavePolicy | None = None,
                 retention: RetentionPolicy | None = None, tiers: TierOptions | None = None,
                 preemption: PreemptionOptions | None = None, job: JobOptions | None = None,
                 save_options: SaveOptions | None = None, load_options: LoadOptions | None = None,
                 step_log: StepLogOptions | None = None, process_group: Any = None) -> None:
        check_path(root, "CheckpointManager(root=...)")
        check_kinds("CheckpointManager", save_policy=(save_policy, SavePolicy), retention=(retention, RetentionPolicy),
                    tiers=(tiers, TierOptions), preemption=(preemption, PreemptionOptions), job=(job, JobOptions),
                    save_options=(save_options, SaveOptions), load_options=(load_options, LoadOptions),
                    step_log=(step_log, StepLogOptions))
        if not isinstance(async_save, bool):
            raise OptionsError(f"CheckpointManager(async_save=...) must be True or False, got {async_save!r}")
        self.save_policy = with_shorthand(save_policy or SavePolicy(), "every_steps", every_steps)
        self.retention = with_shorthand(retention or RetentionPolicy(), "keep_last", keep_last)
        self.preemption = preemption or PreemptionOptions()
        job = job or JobOptions()
        self.async_save = async_save
        self.process_group = process_group
        self.save_options = save_options or SaveOptions()
        self.load_options = load_options or LoadOptions()
        if self.save_options.staging != "blocking":
            raise OptionsError("CheckpointManager takes the snapshot before maybe_save returns; use "
                               "liferaft.async_save directly for overlapped staging")
        self.storage = resolve(root)
        self.coord = Coordinator(process_group, self.save_options.timeout)
        self.preempted = False
        self._preemption = Preemption(self.preemption)
        self._ballot = Ballot(self.coord)       # the votes of the maybe_save calls (``voting``)
        self._last_call: int | None = None     # the step of the last maybe_save
        self._loop = LoopCost()                 # what the saves in flight cost the loop (the auto interval's cost)
        self._last_step: int | None = None
        self._rolled_back: int | None = None    # restore(state, step=K): the steps after K go at the next save
        self._forked: int | None = None         # restore(state) went on from a step older than INTENT (``_fork``)
        self._damaged: set[int] = set()         # committed steps the last restore skipped as damaged
        # a full save was started by this manager or restored: with a step log, its records have a base to replay
        # onto (the same on every rank: saves start collectively)
        self._has_base = False
        self._last_time = time.monotonic()
        self._metrics: dict[int, Mapping[str, float]] = {}
        self._reading: set[int] = set()
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="liferaft-retention") \
            if self.coord.rank == 0 else None
        self._closed = False
        self._root_start = RootStart(self.storage)     # (rank 0's: the start's clean-up, INTENT)
        self._unguard: Callable[[], None] = lambda: None

        def identify() -> tuple[str, str, str, str]:    # rank 0's identity is the job's, its name of the root the root's
            who = this_job(job.job_id)
            return who.job_id, who.source, self.storage.url, self.storage.place

        self.job_id, self.job_source, root_url, root_place = self.coord.run_on_zero(identify, "manager (job id)")
        # (the memory tier's copies name their root, ROOT_KEY: where its files are, links resolved, as rank 0 sees it)
        self._owner = owner_id(root_place)
        self._lease = Lease(self.storage, self.job_id, job.lease_ttl) if self.coord.rank == 0 else None
        learn = self.save_policy.auto_interval or (tiers is not None and tiers.memory_every == "auto")
        if step_log is not None and tiers is None:
            raise OptionsError("CheckpointManager(step_log=...) keeps its records in the memory tier: give "
                               "tiers=TierOptions(memory=MemoryTier(...)) too")
        starts, self._read_only_why, self._branches = self.coord.run_on_zero(lambda: self._start(learn),
                                                                              "manager (start)")
        try:
            hours = self.save_policy.mtbf_hours
            mtbf_s = hours * 3600.0 if hours is not None else \
                mtbf_from_starts(starts, PRIOR_MTBF_HOURS * 3600.0, time.time())
            self._auto = AutoInterval(mtbf_s=mtbf_s) if self.save_policy.auto_interval else None
            self._tiers = Tiers(tiers, self.storage, self.coord, process_group, mtbf_s, self._owner) \
                if tiers is not None else None
            self._saves = SavesInFlight(self._tiers, process_group)
            self._steplog: StepLog | None = None
            if step_log is not None and tiers is not None:
                self._steplog = StepLog(tiers.memory, replicas=step_log.replicas,
                                        max_steps=step_log.max_steps if isinstance(step_log.max_steps, int) else None,
                                        process_group=process_group, timeout=self.save_options.timeout,
                                        allow_pickle=self.save_options.allow_pickle, owner=root_url)
                self._steplog.epoch = len(self._branches)
                self._steplog.live = lambda s, e: live(s, e, self._branches)
        except BaseException:
            self._abandon()                 # (no manager: its start's clean-up and lease must not outlive it)
            raise

    def _abandon(self) -> None:
        """A construction that failed after the start: wait for the start's clean-up (never left running to delete
        what a later manager saves), stop the deleter, release the lease."""
        self._closed = True
        if self._deleter is not None:
            with contextlib.suppress(Exception):
                self._root_start.wait()
            self._deleter.shutdown(wait=True)
        self._unguard()
        if self._lease is not None:
            with contextlib.suppress(Exception):
                self._lease.release()

    def _start(self, learn: bool) -> tuple[list[float], str | None, Branches]:
        """Rank 0: take the lease, record this start (``learn``), start the clean-up of leftovers in the background
        (``startup.RootStart``); (starts, why read-only, the root's rollbacks)."""
        assert self._lease is not None
        try:
            self._lease.acquire()
        except ReadOnlyRootError as e:          # restore only: no lease, no clean-up, no start record
            return [], str(e), self._root_start.read_branches()
        branches = self._root_start.read_branches()
        # (every commit under the root checks the lease right before its marker, every deletion of a step before
        # it: a save or retention pass already running when another job took the root over commits and deletes
        # nothing)
        self._unguard = self._lease.guard()
        starts = record_start(self.storage) if learn else []
        assert self._deleter is not None        # (rank 0's: the start's pass runs before any retention pass)
        self._root_start.begin(self._deleter)
        return starts, None, branches

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
        if self._auto is not None:
            return self._auto.interval_s
        return None if self.save_policy.every_seconds == "auto" else self.save_policy.every_seconds

    @property
    def memory_interval_s(self) -> float | None:
        """With ``TierOptions(memory_every="auto")``: the current time interval between memory-tier saves."""
        return self._tiers.interval_s if self._tiers is not None else None

    # ------------------------------------------------------------------ listing

    def _step_storage(self, step: int) -> Storage:
        return self.storage.child(step_name(step))

    def _pins(self) -> frozenset[int]:
        return read_pins(self.storage)

    def _list(self, deep: bool = False) -> list[StepInfo]:
        """Every step under the root, oldest first (this process; no collective)."""
        return list_steps(self.storage, self._pins(), deep)

    def _live(self, info: StepInfo) -> bool:
        """Whether a listed step belongs to the root's run: no rollback abandoned it (``rollback.live``)."""
        return live(info.step, info.epoch, self._branches)

    def steps(self, verify: bool = False) -> list[StepInfo]:
        """Every step under the root, and in this node's memory tier, with its status and the tiers holding a
        committed copy, oldest first. ``verify`` re-hashes every committed step under the root (reads all its
        data). Not collective: a memory-tier step is listed as this node sees it (its data may be spread over
        the nodes); on rank 0 after the start's clean-up of interrupted saves (which runs in the background from
        the start: another rank may still list their steps as incomplete)."""
        self._root_start.wait()
        listing = self._list(deep=verify)
        if self._tiers is None:
            return [replace(i, tiers=("root",) if i.status == "committed" else ()) for i in listing]
        return self._tiers.listed(listing)

    # ------------------------------------------------------------------ restore

    def restore(self, state: Any, step: int | None = None, strict: bool = True) -> int | None:
        """Load the newest committed step that loads (or ``step``) into ``state``; return its step, or None when
        there is none. A step that fails to load (missing files, bad checksum, damaged manifest) is skipped with a
        warning saying why, and the one before it is tried; a state that does not match raises — unless
        ``strict=False``: then the keys that match are loaded and ``last_load`` (the ``LoadResult``) lists the
        others in ``missing_keys`` / ``unexpected_keys``. (Optimizer state of a parameter that was never stepped,
        and buffers a module does not persist, are no mismatch: see ``liferaft.load``.) With tiers, a newer step
        in memory or on the remote tier is taken first (docs/TIERS.md). With a per-step log, ``restore(state)``
        replays the steps after the newest full checkpoint and returns the newest recoverable step;
        ``restore(state, step=K)`` restores exactly K and replays nothing. That is a rollback: the steps (and
        records) after K stay until the next ``maybe_save``/``save``, which removes them from every tier first
        (``manager.rollback``; docs/MANAGER.md, "Going back")."""
        step = None if step is None else check_step(step, "restore")
        self.last_load = None
        if self._saves.busy:
            try:
                self.wait()                 # a save still in flight commits first, so that restore sees it
            except LiferaftError as e:
                warnings.warn(f"liferaft: the save in flight failed ({e}); restoring from what is committed",
                              stacklevel=2)
        with self._quiet():
            return self._restore(state, step, strict)

    def _restore(self, state: Any, step: int | None, strict: bool) -> int | None:
        # the newest step any manager of this root began to save (one small read, no listing): memory answers
        # alone when it holds one at least that new, and the start's listing is used only if it is that new
        # (and the root's rollbacks as rank 0 knows them: a rollback or fork recorded by a save that then failed)
        intent_at, self._branches = self.coord.run_on_zero(
            lambda: (read_intent_at(self.storage), self._root_start.branches), "restore (intent)")
        if self._steplog is not None:
            self._steplog.epoch = len(self._branches)
        intent = intent_at[0] if intent_at is not None else None
        listing: list[StepInfo] | None = None

        def root_listing() -> list[StepInfo]:       # (collective; once, and not at all when memory answers)
            nonlocal listing
            if listing is None:
                listing = self.coord.run_on_zero(lambda: self._root_start.listing(intent), "restore (listing)")
            return listing

        got: tuple[int, LoadResult] | None = None
        if step is None and self._tiers is not None:
            got = self._tiers.restore(state, intent, lambda: max(
                (i.step for i in root_listing() if i.status == "committed" and self._live(i)), default=None),
                self.load_options, strict, lambda s, e: live(s, e, self._branches))
        if got is None:
            candidates = [(i.step, i.path) for i in restore_candidates(root_listing(), step, self.storage.url,
                                                                       self._live)]

            def load_one(s: int) -> LoadResult:
                self._reading.add(s)            # retention passes leave it alone meanwhile
                try:
                    return load(self._step_storage(s), state, process_group=self.process_group, strict=strict,
                                options=self.load_options)
                finally:
                    self._reading.discard(s)

            got = first_that_loads(self.coord, candidates, load_one, raise_last=True)
        if got is None:
            if self._steplog is not None:
                self._steplog.start_fresh(state)
            return None
        done, self.last_load = got
        # (restoring the newest: the newer committed steps were skipped as damaged; not after a rollback)
        self._damaged = {i.step for i in listing or () if i.step > done and i.status == "committed"} \
            if step is None else set()
        self.lossy_state = self.coord.run_on_zero(lambda: self._lossy_of(done), "restore (lossy state)")
        self._has_base = True
        # (the saves since a full one: known from the root's listing; restored from memory unlisted, the next
        # save to the root is a full one)
        since = next((i.since_full for i in listing or () if i.status == "committed" and i.step == done), None)
        self._saves.base = (done, since) if since is not None else None    # None: the next save is a full one
        self._root_start.restored(done)
        self._rolled_back = done if step is not None else None
        if self._steplog is not None and step is not None:
            self._steplog.resume_at(state, done)    # exactly the step asked for: nothing replayed
        elif self._steplog is not None:         # the steps after it, replayed from the per-step log
            done = self._steplog.recover(state, done)
        # the newest step that loads is older than one a manager began to save in this epoch (``INTENT``), and the
        # root holds no committed step newer (none skipped as damaged: those stay the run's): the run goes on from
        # it, and any copy of a newer step (a node's memory that this restore could not reach, a save cut short)
        # belongs to the run before; recorded as a new epoch at the next save (``rollback``), nothing removed
        newer = any(i.step > done and i.status == "committed" and self._live(i) for i in listing or ())
        # (an INTENT of an older epoch is the run before a rollback's; one that records no epoch, or a later one,
        # is taken as this epoch's: a fork too many records an epoch, one too few may restore an abandoned copy)
        self._forked = done if step is None and intent_at is not None and done < intent_at[0] and not newer and \
            (intent_at[1] is None or intent_at[1] >= len(self._branches)) else None
        self._last_step, self._last_time = done, time.monotonic()
        return done

    # ------------------------------------------------------------------ preemption

    def handle_preemption(self) -> None:
        """Install the handlers of ``PreemptionOptions.signals`` now (call it on every rank, from the main
        thread: OptionsError elsewhere). A signal only sets a flag; the next ``maybe_save`` saves. Done by the
        first ``maybe_save`` from the main thread unless ``install="explicit"``; idempotent; ``close()`` puts
        the previous ones back (``preemption.PreemptionHandlers``: any number of managers, closed in any order)."""
        if not self._closed:
            self._preemption.install()

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None,
                   force: bool = False) -> bool:
        """Save ``state`` as ``step`` if a save policy says so (or ``force``, or after a preemption signal);
        return whether a save started. With ``async_save`` it returns once the snapshot is taken (an earlier
        save still in flight is waited for first), else once the step is committed. With more than one rank,
        what rests on each rank's clock or view (a time interval, a preemption signal, the memory tier's time
        interval, the per-step log's ring) is voted at the end of each call and acted on by every rank at the
        next: one step later than the rank that saw it, and no round trip at any step (the vote's all-reduce
        runs during the step)."""
        if not self._closed:
            self._preemption.at_first_save()
        step = check_step(step, "maybe_save")
        self._loop.call(time.perf_counter(), self._saves.busy,     # (what a save in flight costs the loop)
                        self._tiers is not None and self._tiers.busy, self._saves.stall)
        log = self._steplog
        voting = self._voting()
        if voting:
            self._ballot.begin()
        failed: Exception | None = None     # this step's record failed (maybe on this rank alone): raised at the end
        try:
            self._go_on()
            if log is not None:
                try:
                    log.record(step, state)     # this step's record (the gradients were captured in step())
                except DistributedError:
                    raise               # (a lost peer, a broken group: every rank sees it, no decision is shared)
                except Exception as e:  # noqa: BLE001 - raised once this call's decisions are made, as the peers'
                    failed = e
                self._log_covers(log)
            reason = "force" if force else self.save_policy.due(step, time.monotonic(), self._last_step,
                                                                self._last_time, self.interval_s)
            local = Views(reason == "every_seconds", self._preemption.signalled,
                          self._tiers is not None and self._tiers.due(step))
            self._settle()              # (this rank's view of the saves in flight; the votes make it common)
            local = local._replace(log_full=log is not None and log.full,
                                   log_half=log is not None and log.save_due and not self._saves.busy)
            self._last_call = step
            if voting:
                auto_memory = self._tiers is not None and self._tiers.auto is not None
                reason, local = agree(reason, local, self._ballot.take(local), auto_memory)
            started = self._decide(step, state, metrics, force, reason, local, voting)
        except BaseException as e:
            _note_record(e, failed, step)   # (the record's error, held until the end: not lost behind this one)
            if voting:                  # (the record, the accounting or the save raised on this rank alone, maybe)
                self._ballot.on_error(lambda: self._votes(step))
            raise
        if voting:
            try:
                self._ballot.cast(self._votes(step))
            except BaseException as e:
                _note_record(e, failed, step)
                raise
        if failed is not None:
            # (after the decisions every rank makes alike: a peer saving this step finds this rank in the save)
            failed.add_note(f"liferaft: the per-step record of step {step} failed on this rank; this maybe_save "
                            f"still {'started a save' if started else 'made its decisions'} with the other ranks")
            raise failed
        return started

    def _log_covers(self, log: StepLog) -> None:
        """Where the per-step log covers what the memory tier covers (as many replicas, no parity), a failure costs
        the replay since the last full checkpoint, not the work: the memory tier's Young/Daly interval is stretched
        accordingly (not while the chain has a hole, nor for CUDA records)."""
        if self._tiers is not None and self._tiers.auto is not None:
            share = log.replay_share
            mem = self._tiers.memory
            covers = log.replicas >= mem.replicas and not mem.parity
            self._tiers.auto.loss = share if share is not None and covers else 1.0

    def _voting(self) -> bool:
        """Whether the ranks vote at each ``maybe_save`` (``voting``): with more than one rank, when a decision
        rests on each rank's clock or view (a time interval, a preemption signal, the memory tier's time interval,
        the per-step log's ring)."""
        return self.coord.world > 1 and (self.save_policy.every_seconds is not None or self._preemption.wanted
                                         or self.memory_interval_s is not None or self._steplog is not None)

    def _votes(self, step: int) -> Views:
        """This rank's votes for the next ``maybe_save``, cast once this one's saves have started: the time
        interval elapsed, a preemption signal, the memory tier's time interval elapsed (a step-based
        ``memory_every`` is decided by each rank alone), the per-step log's ring full once the next step is
        recorded (a save seen finished counted as durable: it will be at the next call), a full checkpoint due to
        free it (``StepLog.save_due``) with no save in flight."""
        log = self._steplog
        done = self._saves.finished()           # a save this rank sees finished since the call began: its step
        return Views(self.save_policy.time_due(time.monotonic(), self._last_time, self.interval_s),
                     self._preemption.signalled,
                     self._tiers is not None and self._tiers.auto is not None and self._tiers.due(step),
                     log is not None and log.full_after_next(done),
                     log is not None and log.save_due and not self._saves.busy)

    def _decide(self, step: int, state: Any, metrics: Mapping[str, float] | None, force: bool, reason: str | None,
                views: Views, voting: bool) -> bool:
        preempt, log_full = views.preempt, views.log_full
        if preempt:
            reason = reason or "preemption"
        if views.memory and reason is None and self._tiers is not None:
            # (skipped on every rank while the previous memory save or a save to the root is still running)
            with self._quiet():
                self._tiers.save(step, state, replace(self.save_options, metadata={
                    **dict(self.save_options.metadata), "step": step, EPOCH_KEY: len(self._branches),
                    ROOT_KEY: self._owner}))
        full_log = log_full
        if full_log:
            # a save in flight frees the ring once durable: wait for it rather than start another; then every rank
            # has the same durable step (the newest save, started by all), so the ring's state is the same on
            # every rank, and only a ring still full takes a synchronous save
            if self._saves.busy:
                self.wait()
            full_log = self._steplog is not None and self._steplog.full
            if voting:
                # (agreed again: a record one rank forgot, its background publish failed twice, leaves its ring
                # short of full where the others' is full; a rank left out of the synchronous save would hang it)
                full_log = self.coord.all_max([int(full_log)], "maybe_save (ring full)")[0] > 0
        if full_log and self._last_step != step:
            reason = reason or "step log full"
        elif views.log_half:
            reason = reason or "step log filling"       # (asynchronous: frees the ring before it fills)
        if self._steplog is not None and not self._has_base:
            # no full checkpoint to replay the records onto yet: take one now (async with async_save), so that a
            # crash before the first interval save resumes at the last step, not at nothing
            reason = reason or "step log: first full checkpoint"
        if reason is None or (self._last_step == step and not force):
            return False
        if full_log and not preempt:            # the ring is full: a durable full checkpoint frees it
            self._save(step, state, metrics, reason, wait=True)
        elif preempt:
            t0 = time.monotonic()
            self._save(step, state, metrics, reason, wait=True, timeout=self.preemption.deadline)
            self.preempted = True
            spent = time.monotonic() - t0
            if spent > self.preemption.deadline:
                warnings.warn(f"liferaft: the preemption save of step {step} took {spent:.0f} s, more than "
                              f"PreemptionOptions.deadline={self.preemption.deadline:.0f} s", stacklevel=2)
        elif self._tiers is not None and self._tiers.drain:
            with self._quiet():
                self._drain_save(step, state, metrics, reason)
        else:
            self._save(step, state, metrics, reason, wait=not self.async_save)
        return True

    def _go_on(self) -> None:
        """The first ``maybe_save`` or ``save`` after ``restore(state, step=K)``: the run goes on from K, a new epoch
        of the root (``rollback``). Collective: a pinned step after K raises on every rank before anything changes;
        then rank 0 records the rollback in ``BRANCHES`` and removes the steps after K from the root and the remote
        tier, every node from its memory tier, every rank its per-step log's records. A read-only root: nothing."""
        after = self._rolled_back
        if after is None and self._forked is not None and not self.read_only:
            self._fork(self._forked)
        if after is None or self.read_only:
            return
        self.wait()                             # (no save in flight writes a step the removal would miss)
        if self._tiers is not None:
            self._tiers.wait()
        pinned = self.coord.run_on_zero(lambda: pinned_after(self._list(), after), "rollback (pins)")
        check_pins([], after, self.storage.url, pinned)      # (on every rank, before anything changes)

        if self._steplog is not None:
            self._steplog.go_on()               # (first: a crash after BRANCHES must find no record to replay)

        def forget() -> Branches:
            if self.coord.rank == 0:            # (BRANCHES first, then the root's steps; a retry records no second)
                self._root_start.go_back(after, self._list())
            if self._tiers is not None:
                self._tiers.forget_after(after, self.coord.rank == 0)
            return self._root_start.branches if self.coord.rank == 0 else ()

        self._branches = self.coord.run(forget, "rollback (remove the steps after the restored one)")[0]
        self._root_start.gone_back()
        if self._steplog is not None:
            self._steplog.epoch = len(self._branches)
        self._rolled_back, self._damaged = None, set()

    def _fork(self, step: int) -> None:
        """The first save after a restore that went on from ``step``, older than the root's ``INTENT``: a new epoch
        whose branch is ``step`` is recorded in ``BRANCHES`` (rank 0; every rank learns it), so that no restore takes
        a copy of a newer step saved before it, from any tier (``rollback.live``). Nothing is removed: the newer
        copies under the root are leftovers the start removed or damaged steps a restore skipped."""
        def record() -> Branches:
            if self.coord.rank == 0:
                self._root_start.fork(step)
            return self._root_start.branches if self.coord.rank == 0 else ()

        self._branches = self.coord.run(record, "restore (a new epoch from an older step)")[0]
        if self._steplog is not None:
            self._steplog.epoch = len(self._branches)
        self._forked = None

    def save(self, step: int, state: Any, metrics: Mapping[str, float] | None = None) -> None:
        """Save now, whatever the policies say (same waiting rules as ``maybe_save``)."""
        step = check_step(step, "save")
        self._go_on()
        self._settle()
        self._save(step, state, metrics, "explicit", wait=not self.async_save)

    def _begin_save(self, step: int) -> None:
        """Wait for the previous save (its error is raised here, as itself), check the lease and record the step in
        the root's ``INTENT`` (never lowered within an epoch) before anything of it is written, on every rank."""
        self._check_writable()
        self.wait()
        lease = self._lease

        def check() -> None:                    # (rank 0: the start's clean-up is done before the root changes)
            if lease is not None:
                lease.check()
            self._root_start.begin_save(step)

        self.coord.run(check if self.coord.rank == 0 else lambda: None, "save (lease)")

    def _options(self, step: int, reason: str, metrics: Mapping[str, float] | None, since_full: int) -> SaveOptions:
        """The save options of a save by this manager (its manifest ``extra`` says why and by whom)."""
        meta = {**dict(self.save_options.metadata), "step": step, "reason": reason, EPOCH_KEY: len(self._branches),
                ROOT_KEY: self._owner,
                "metrics": {str(k): float(v) for k, v in (metrics or {}).items()}, "job_id": self.job_id,
                "since_full": since_full, **({"lossy_state": self.lossy_state} if self.lossy_state else {})}
        return replace(self.save_options, metadata=meta)

    def _lossy_of(self, step: int) -> str | None:
        """The ``lossy_state`` the restored ``step`` recorded (its memory copy, else the root's), if any."""
        return lossy_state_of(([self._tiers.memory.step_storage(step)] if self._tiers else [])
                              + [self._step_storage(step)])

    def mark_lossy(self, reason: str) -> None:
        """The live state is an approximation from now on (e.g. a stage rebuilt by ``liferaft.rebuild_stage``): every
        later save records ``reason`` in its manifest as ``lossy_state``, and a restore of such a step keeps it."""
        self.lossy_state = "; ".join(x for x in (self.lossy_state, str(reason)) if x)

    def _quiet(self) -> Any:
        """The per-step log's hooks off (liferaft's own walks of the state are no training steps)."""
        return self._steplog.suspended() if self._steplog is not None else contextlib.nullcontext()

    def _save(self, step: int, state: Any, metrics: Mapping[str, float] | None, reason: str, wait: bool,
              timeout: float | None = None) -> None:
        with self._quiet():
            self._save_now(step, state, metrics, reason, wait, timeout)

    def _save_now(self, step: int, state: Any, metrics: Mapping[str, float] | None, reason: str, wait: bool,
                  timeout: float | None = None) -> None:
        self._begin_save(step)
        self._loop.started()
        self._has_base = True
        base = self._saves.base if self._saves.base is not None and self._saves.base[0] != step else None
        since = base[1] + 1 if base is not None and base[1] + 1 < self.save_policy.full_every else 0
        # if_busy="wait": a save this manager decided on is never skipped (a skipped one would be taken as
        # committed); another save of the process in flight (the memory tier's) is waited for instead
        opts = replace(self._options(step, reason, metrics, since), overwrite=True, if_busy="wait",
                       incremental_base=step_name(base[0]) if base is not None and since else None)
        if timeout is not None:                     # a preemption save: no rank waits past the deadline
            opts = replace(opts, timeout=min(opts.timeout, timeout))
        self._last_step, self._last_time = step, time.monotonic()
        self._committed(self._saves.save(step, state, self._step_storage(step), opts, metrics, since,
                                         base[0] if base is not None and since else None, wait))

    def _drain_save(self, step: int, state: Any, metrics: Mapping[str, float] | None, reason: str) -> None:
        """Save into the memory tier and drain that copy to the root in the background (a full step)."""
        assert self._tiers is not None
        self._begin_save(step)
        self._loop.started()
        self._has_base = True
        self._last_step, self._last_time = step, time.monotonic()
        self._committed(self._saves.drain_save(step, state, self._options(step, reason, metrics, 0), metrics,
                                               not self.async_save))

    def _settle(self) -> None:
        """If the save in flight has finished, account for it (raises its error)."""
        self._committed(self._saves.settle())

    def wait(self) -> None:
        """Wait for the save in flight (raises what it raised, on every rank)."""
        self._committed(self._saves.wait())

    def _committed(self, finished: list[Finished]) -> None:
        """Account for the saves of this manager that committed (``SavesInFlight``): the per-step log's ring is
        freed up to them, the auto interval learns their cost, retention runs."""
        for f in finished:
            self._damaged.discard(f.step)       # (saved again: no longer the damaged copy)
            if self._steplog is not None:
                self._steplog.mark_durable(f.step)
            if self._auto is not None:
                # per rank (no collective here: ranks see a save finish at different calls); maybe_save agrees on
                # the time policy's decision anyway. The cost: what the loop lost while the save ran (its stall,
                # and on a host whose cores all train, the background's share of them: policies.LoopCost)
                stall = self._saves.stall
                persist = float(f.result.timings.get("total", stall)) if f.result is not None else \
                    self._saves.drained_in()
                self._auto.record(self._loop.cost(stall, persist), persist)
            if f.metrics:
                self._metrics[f.step] = dict(f.metrics)
            if self._deleter is not None and self.retention.deletes_anything:
                self._deleter.submit(self._apply_retention)     # one worker: passes run one after the other

    def _apply_retention(self) -> None:
        """Rank 0, background: delete committed steps the retention policy does not keep (never the step being
        saved, nor the base it references: its manifest is not there yet, nor a step being read)."""
        try:
            apply_retention(self.storage, self.retention, self._metrics, self._saves.busy_steps() | self._reading,
                            self._live, self._damaged)
        except Exception as e:  # noqa: BLE001 - retention must not stop training; it runs again after the next save
            warnings.warn(f"liferaft: removing old checkpoints under {self.storage.url} failed: {e}", stacklevel=2)

    # ------------------------------------------------------------------ pins, close

    def pin(self, step: int) -> None:
        """Keep ``step`` whatever the retention policy says (recorded under the root; rank 0 writes it)."""
        step = check_step(step, "pin")
        self._check_writable()
        if self.coord.rank == 0:
            write_pins(self.storage, self._pins() | {step})

    def unpin(self, step: int) -> None:
        step = check_step(step, "unpin")
        self._check_writable()
        if self.coord.rank == 0:
            write_pins(self.storage, self._pins() - {step})

    def close(self) -> None:
        """Wait for the save in flight and for deletions, put the previous signal handlers back, release the
        lease; then raise, on every rank, what failed on any. Collective."""
        if not self._closed:
            self._closed = True
            self.coord.run(self._shut_down, "manager (close)")   # every rank returns after the deletions

    def _shut_down(self) -> None:
        err = _run_all([self._finish_saves, self._tiers.wait if self._tiers is not None else None,
                        self._steplog.close if self._steplog is not None else None,
                        # (its warnings: an error when warnings are errors, raised below)
                        self._root_start.wait if self._deleter is not None else None])
        self._preemption.remove()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
        self._unguard()
        if self._lease is not None:
            self._lease.release()
        if err is not None:
            raise err

    def _finish_saves(self) -> None:
        """Take the vote the last ``maybe_save`` cast (every rank cast one; a preemption signal in it is only
        warned of), then wait for the save in flight."""
        last = self._ballot.last()
        if last is not None and last.preempt and not self.preempted:
            warnings.warn("liferaft: a preemption signal reached a rank at the last maybe_save before "
                          f"close() (step {self._last_call}); with several ranks a signal is acted on at "
                          "the maybe_save after the one that saw it, so it was not saved: save the last "
                          "step explicitly (SavePolicy(last_step=...) or mgr.save) (docs/MANAGER.md)",
                          stacklevel=7)         # (the caller of close())
        self.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LEASE", "PINS", "CheckpointManager", "StepInfo", "list_steps", "step_name"]
