"""Rank functions for tests/multiproc/test_steplog_forget.py (imported as ``multiproc._steplog_forget_ranks``): two
ranks on one node train a small model with the per-step log, ``kill -9`` themselves after ``stop``; with ``slow``
the node's lowest rank is slowed in the removal of the records past the resume step (a slow scan of many slots),
so a sibling that returned from ``restore`` first would publish its next record into the removal's way."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch import nn

from liferaft import CheckpointManager, MemoryTier, StepLogOptions, TierOptions
from liferaft.tiers.steplog import StepLog


class _SlowScan(StepLog):
    def _forget_after(self, step: int) -> None:
        time.sleep(1.0)
        super()._forget_after(step)


def forget_job(rank: int, world: int, root: str, base: str, stop: int, slow: bool, crash: bool) -> Any:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    st = {"model": model, "optim": opt}
    tier = MemoryTier("j", node="n0", base=base)
    mgr = CheckpointManager(root, every_steps=4, tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                            step_log=StepLogOptions(replicas=1, max_steps=16), async_save=False)
    if slow and rank == 0:
        assert mgr._steplog is not None
        mgr._steplog.__class__ = _SlowScan
    start = mgr.restore(st)
    for s in range((start if start is not None else -1) + 1, stop + 1):
        g = torch.Generator().manual_seed(s * 10 + rank)
        model(torch.randn(3, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(s, st)
    time.sleep(1.5)                     # the slow rank's removal, if it still ran, would take the sibling's record
    if crash:
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"start": start, "recovery": mgr._steplog.last_recovery if mgr._steplog else None}
    mgr.close()
    return out
