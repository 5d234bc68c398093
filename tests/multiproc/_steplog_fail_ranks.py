"""Rank functions for ``test_steplog_fail.py``: the job of ``_steplog_ranks`` where rank 0's per-step log fails on
that rank alone and the loop catches the error and goes on.

``"background"`` runs every record through the background publish a CUDA record takes (this machine has no GPU:
``cudastandin`` stands in for the CUDA layer only)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

from cudastandin import copy_to_generation, put_deferred
from multiproc._steplog_ranks import build, snapshot, train_step

import liferaft
from liferaft import CheckpointManager, JobOptions, MemoryTier, PreemptionOptions, StepLogOptions, TierOptions
from liferaft.state import optsteps
from liferaft.tiers import stepcuda, steplog
from liferaft.tiers.steplist import slot_name
from liferaft.tiers.steplog import StepLog
from liferaft.tiers.steprecord import read_header


class _Done:
    def synchronize(self) -> None:
        pass


def _deferred() -> None:
    """Every record's tensors through ``CudaCopies`` and the background publish (in this process only)."""
    stepcuda.CudaCopies.enqueue = lambda self, t, off, gen: copy_to_generation(self, t, off, gen, _Done())
    stepcuda.CudaCopies.fence = lambda self, since: None     # type: ignore[method-assign]
    steplog.StepLog._put = put_deferred                     # type: ignore[method-assign]


def _manager(rank: int, root: str, base: str, every: int, max_steps: int | str) -> CheckpointManager:
    tier = MemoryTier("steplog-fail", node=f"node{rank}", base=base, timeout=20)
    return CheckpointManager(root, save_policy=liferaft.SavePolicy(every_steps=every),
                             tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                             step_log=StepLogOptions(replicas=1, max_steps=max_steps),
                             preemption=PreemptionOptions(signals=[signal.SIGUSR1]),
                             job=JobOptions(job_id="steplog-fail", lease_ttl=5.0),
                             save_options=liferaft.SaveOptions(timeout=20))


def _inject(log: StepLog, rank: int, where: str, at: int, times: int = 1) -> None:
    """Rank 0's record of ``at`` fails: its walk of the state (``capture``) or the writing of its header
    (``publish``: a full /dev/shm) ``times`` times, or the background publish's header and again at its retry
    (``background``), or the copy of a gradient in ``optimizer.step()``'s hook (``hook``: the step itself must
    run, as on the other ranks)."""
    if where == "hook":             # (the gradients' copy in step ``at``'s optimizer.step: the last record, at - 1)
        capture, put = log._capture, log._put

        def no_room(t: Any) -> Any:
            raise OSError(28, f"injected: no space left on the shared memory (a gradient of step {at})")

        def hook(*args: Any, **kwargs: Any) -> Any:
            if rank == 0 and log._expect == at:
                log._put = no_room
            try:
                return capture(*args, **kwargs)
            finally:
                log._put = put
        log._capture = hook
        for h in log._hooks:        # (the hooks call the bound method they were given: hook them again)
            h.remove()
        log._hooks = optsteps.hook_optimizers(log.optimizers, log._capture)
        return
    obj, name = (log._rest, "capture") if where == "capture" else (log, "_publish")
    real = getattr(obj, name)
    left = [2 if where == "background" else times]

    def fail(*args: Any, **kwargs: Any) -> Any:
        step = args[1]["step"] if name == "_publish" else log._expect - 1
        if rank == 0 and step == at and left[0]:
            left[0] -= 1
            raise OSError(28, f"injected: no space left on the shared memory ({name} of step {at})")
        return real(*args, **kwargs)

    setattr(obj, name, fail)


def one_rank_fails(rank: int, world: int, root: str, base: str, where: str, at: int, signal_at: int | None,
                   max_steps: int | str, retry: int = 0, every: int = 6) -> dict[str, Any]:
    """Train steps 0..15 under DDP/SGD, full checkpoints every ``every`` steps; rank 1 gets SIGUSR1 after step
    ``signal_at`` (a preemption: every rank must stop at the same step). At step ``at`` on rank 0 alone:
    ``where="capture"`` / ``"publish"`` / ``"background"``: its record fails (``_inject``: no record of ``at`` on
    that rank); ``where="forget"``: the newest record is forgotten before ``maybe_save`` (as a background publish
    that failed twice leaves it), so that rank's ring is one short of full where the others' is full (the ring
    is kept from freeing itself early: no "step log filling" saves). ``retry``: every rank calls ``maybe_save``
    of ``at`` again (rank 0's record of it made then, kept on its node only); 2: rank 0's fails again. Returns {"caught" (steps whose maybe_save
    raised), "stopped", "committed", "ring", "held", "durable", "unsent" (bytes the last replication did not
    send: its peer held them, the ranks' exchanges in step)}."""
    if where == "background":
        _deferred()
    st = build("ddp", "sgd", world)
    mgr = _manager(rank, root, base, every, max_steps)
    mgr.restore(st)
    log = mgr._steplog
    assert log is not None
    if where == "forget":
        class NoEarlySaves(StepLog):
            @property
            def save_due(self) -> bool:
                return False
        log.__class__ = NoEarlySaves
    caught: list[int] = []
    stopped = -1
    if where not in ("forget", "none"):
        _inject(log, rank, where, at, max(1, retry))
    for step in range(16):
        train_step(st, rank, step)
        if rank == 0 and where == "forget" and step == at:
            newest = max(log.ring.held, key=log.ring.held.__getitem__)
            log.ring.held.pop(newest)                           # (what StepLog._publish_again does)
        if step == signal_at and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")             # (the gap the failed record leaves)
                mgr.maybe_save(step, st)
        except OSError:
            caught.append(step)
        if retry and step == at:
            try:
                mgr.maybe_save(step, st)
            except OSError:
                caught.append(step)
        if caught and caught[-1] == step:
            continue
        if mgr.preempted:
            stopped = step
            break
    log.wait()
    out = {"caught": caught, "stopped": stopped, "ring": log.max_steps, "held": log.held_steps(),
           "durable": log.durable, "unsent": log._sender.saved_bytes, "state": snapshot(st)}
    mgr.close()
    out["committed"] = [i.step for i in mgr.steps() if i.status == "committed"]
    return out


def _maybe_save(mgr: CheckpointManager, step: int, st: Any, caught: list[int]) -> None:
    """``maybe_save``; an OSError (the injected failure) noted in ``caught`` (the warnings of the gap it leaves
    silenced)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.maybe_save(step, st)
    except OSError:
        caught.append(step)


def saved_at_the_failed_step(rank: int, world: int, root: str, base: str, at: int, last: int) -> dict[str, Any]:
    """Every rank saves ``at`` explicitly (an end-of-epoch checkpoint, say), then rank 0's record of ``at`` fails
    (``publish``: its hole is covered by that checkpoint, no other is taken); train to ``last``; a fresh manager restores: the full checkpoint ``at`` and the records
    after it. Returns the recovery, how many optimizer steps each record holds, and whether the recovered state is
    the trained one."""
    st = build("ddp", "sgd", world)
    mgr = _manager(rank, root, base, 1000, 64)
    mgr.restore(st)
    log = mgr._steplog
    assert log is not None
    caught: list[int] = []
    _inject(log, rank, "publish", at)
    for step in range(last + 1):
        train_step(st, rank, step)
        if step == at:
            mgr.save(step, st)
            mgr.wait()
        _maybe_save(mgr, step, st, caught)
    log.wait()
    calls = {s: len(read_header(log.root, slot_name(rank, sl)).doc["calls"]) for sl, s in log.ring.held.items()}
    truth = snapshot(st)
    mgr.close()
    st2 = build("ddp", "sgd", world)
    mgr2 = _manager(rank, root, base, 1000, 64)
    start = mgr2.restore(st2)
    assert mgr2._steplog is not None
    recovery = dict(mgr2._steplog.last_recovery)
    got = snapshot(st2)
    mgr2.close()
    return {"caught": caught, "calls": calls, "start": start, "full": recovery["full"],
            "differs": sorted(k for k in truth if truth[k] != got.get(k))}


def rolled_back_after_a_failed_record(rank: int, world: int, root: str, base: str, at: int, back: int,
                                      last: int) -> dict[str, Any]:
    """Full checkpoints every ``back`` steps; rank 0's record of ``at`` fails (its exchange held empty); train to
    ``last``; every rank rolls back to ``back`` (``restore(step=back)``) and trains to ``last`` again. Returns
    {"caught", "unsent" (per step after the rollback: bytes the replication did not send)}; close must not
    time out."""
    st = build("ddp", "sgd", world)
    mgr = _manager(rank, root, base, back, 64)
    mgr.restore(st)
    log = mgr._steplog
    assert log is not None
    _inject(log, rank, "publish", at)
    caught: list[int] = []
    unsent = {}
    for step in range(last + 1):
        train_step(st, rank, step)
        _maybe_save(mgr, step, st, caught)
    mgr.wait()
    mgr.restore(st, step=back)
    for step in range(back + 1, last + 1):
        train_step(st, rank, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.maybe_save(step, st)
        log.wait()
        unsent[step] = log._sender.saved_bytes
    mgr.close()
    return {"caught": caught, "unsent": unsent}
