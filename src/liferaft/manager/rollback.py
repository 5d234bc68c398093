"""Going back: a run that goes on from an older step than the root's newest, and what it must not break.

``restore(state, step=K)`` loads step K. The steps newer than K stay (a later ``restore(state)`` may still take
them) until the run goes on: the first ``maybe_save`` or ``save`` after it starts another future, and before it
saves anything the manager removes the steps newer than K from the root, every node's memory tier and the remote
tier (``forget_after``). Left there, they would be the newest at the next restart (a resume on the abandoned
future), retention would keep them as the newest and delete the new run's saves, and a save of the new run at a
step they have would overwrite files they reference. A pinned step newer than K is never removed: the rollback
then raises (unpin it or copy it elsewhere first) before anything is removed.

A run that saves a step older than the root's newest without such a rollback (a loop that restarts at 0 on a
root holding later steps, a ``restore`` whose step the loop ignored) is refused (``check_order``): its saves
would overwrite what the newer steps reference. As the step log does with its records (docs/STEPLOG.md).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from liferaft.errors import CheckpointExistsError, OptionsError
from liferaft.format.limits import MAX_INT
from liferaft.manager.listing import StepInfo, delete_step
from liferaft.storage import Storage


def forget_after(storage: Storage, step: int, listing: Sequence[StepInfo]) -> list[int]:
    """Delete every step of ``listing`` (the steps under the root or tier ``storage``) newer than ``step``, of any
    status, newest first (a step before the ones it references); return them. A pinned one among them raises
    CheckpointExistsError first, deleting nothing."""
    newer = sorted((i for i in listing if i.step > step), key=lambda i: i.step, reverse=True)
    pinned = [i.step for i in newer if i.pinned]
    if pinned:
        raise CheckpointExistsError(
            f"{storage.url}: the run goes on from step {step} (restore(state, step={step})), which removes the "
            f"steps after it, but step(s) {pinned} are pinned; unpin them (mgr.unpin) or copy them elsewhere first")
    for info in newer:
        delete_step(storage, info.step)
    return [i.step for i in newer]


def check_step(step: object, where: str) -> int:
    """``step`` as an int, if it is one in [0, 2**63) (a numpy integer too, not a bool); else OptionsError naming
    ``where``: a step's folder name, listing and ordering rest on it."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= int(step) <= MAX_INT:
        raise OptionsError(f"{where}: the step must be an integer in [0, 2**63), got {step!r:.60}")
    return int(step)


def check_order(step: int, newest: int | None, url: str) -> None:
    """Refuse (CheckpointExistsError) a save of ``step`` when the root holds a newer committed step ``newest``."""
    if newest is not None and step < newest:
        raise CheckpointExistsError(
            f"{url}: saving step {step}, but the root holds step {newest}, newer: this run went back without "
            f"restore(state, step={step})? A save there would overwrite what the newer steps reference. Resume with "
            "the step restore(state) returns, roll back with restore(state, step=K) (the steps after K are removed "
            "at the next save), or use another root")


__all__ = ["check_order", "check_step", "forget_after"]
