"""Rank functions for ``test_steplog_fail.py``: the job of ``_steplog_ranks`` under a preemption signal, where rank
0's per-step log fails once on that rank alone and the loop catches the error and goes on."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

from multiproc._steplog_ranks import build, train_step

import liferaft
from liferaft import CheckpointManager, JobOptions, MemoryTier, PreemptionOptions, StepLogOptions, TierOptions
from liferaft.tiers.steplog import StepLog


def one_rank_fails(rank: int, world: int, root: str, base: str, where: str, at: int, signal_at: int | None,
                   max_steps: int | str) -> dict[str, Any]:
    """Train steps 0..15 under DDP/SGD, full checkpoints every 6 steps; rank 1 gets SIGUSR1 after step
    ``signal_at`` (a preemption: every rank must stop at the same step). At step ``at`` on rank 0 alone:
    ``where="capture"`` / ``"publish"``: the record's walk of the state, or the writing of its header, fails (a
    full /dev/shm: no record of ``at`` on that rank);
    ``where="forget"``: the newest record is forgotten before ``maybe_save`` (as a background publish that failed
    twice leaves it), so that rank's ring is one short of full where the others' is full (the ring is kept from
    freeing itself early: no "step log filling" saves). Returns {"caught", "stopped", "committed", "ring",
    "held", "durable"}."""
    st = build("ddp", "sgd", world)
    tier = MemoryTier("steplog-fail", node=f"node{rank}", base=base, timeout=20)
    mgr = CheckpointManager(root, save_policy=liferaft.SavePolicy(every_steps=6),
                            tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                            step_log=StepLogOptions(replicas=1, max_steps=max_steps),
                            preemption=PreemptionOptions(signals=[signal.SIGUSR1]),
                            job=JobOptions(job_id="steplog-fail", lease_ttl=5.0),
                            save_options=liferaft.SaveOptions(timeout=20))
    mgr.restore(st)
    log = mgr._steplog
    assert log is not None
    if where == "forget":
        class NoEarlySaves(StepLog):
            @property
            def save_due(self) -> bool:
                return False
        log.__class__ = NoEarlySaves
    caught, stopped = [0], -1
    if where in ("capture", "publish"):
        obj, name = (log._rest, "capture") if where == "capture" else (log, "_publish")
        real = getattr(obj, name)

        def fail(*args: Any, **kwargs: Any) -> Any:
            if rank == 0 and log._expect == at + 1 and not caught[0]:
                raise OSError(28, f"injected: no space left on the shared memory ({name} of step {at})")
            return real(*args, **kwargs)

        setattr(obj, name, fail)
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
            caught[0] += 1
            continue
        if mgr.preempted:
            stopped = step
            break
    out = {"caught": caught[0], "stopped": stopped, "ring": log.max_steps, "held": log.held_steps(),
           "durable": log.durable}
    mgr.close()
    out["committed"] = [i.step for i in mgr.steps() if i.status == "committed"]
    return out
