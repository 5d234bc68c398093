"""Going back: a run that goes on from an older step than the root's newest, and what it must not break.

``restore(state, step=K)`` loads step K. The steps newer than K stay (a later ``restore(state)`` may still take
them) until the run goes on: the first ``maybe_save`` or ``save`` after it starts another run, an epoch of the root.
Before it saves anything the manager records the rollback in the root's ``BRANCHES`` ((epoch, K), appended), then
removes the steps newer than K from the root, every node's memory tier, the remote tier and the per-step log. Every
save records its epoch (``extra.liferaft_rollbacks``; the per-step log's records too); a step saved in an earlier epoch than a rollback to before it is
abandoned (``live``), wherever a copy of it is left — a node that missed the rollback and comes back with its
memory, a removal a crash interrupted — and no restore, retention pass or order check takes it. Left there,
abandoned steps would be the newest at the next restart (a resume on the abandoned run), retention would keep them
as the newest and delete the new run's saves, and a save of the new run at a step they have would overwrite files
they reference. A pinned step newer than K is never removed: the rollback then raises on every rank (unpin it or
copy it elsewhere first) before anything is recorded or removed.

A run that saves a step older than the root's newest live step without such a rollback (a loop that restarts at
0 on a root holding later steps, a ``restore`` whose step the loop ignored) is refused (``check_order``): its saves
would overwrite what the newer steps reference.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from liferaft.errors import CheckpointExistsError, OptionsError
from liferaft.format.limits import MAX_INT
from liferaft.manager.listing import StepInfo, delete_step
from liferaft.storage import Storage

Branches = tuple[tuple[int, int], ...]   # the root's rollbacks: (epoch, the step the run went back to), in order


def live(step: int, epoch: int, branches: Branches) -> bool:
    """Whether step ``step``, saved in ``epoch`` (the number of rollbacks of the root before its save), belongs to
    the root's current run: no later rollback went back to before it (pure)."""
    return all(step <= k for e, k in branches if e > epoch)


def pinned_after(listing: Sequence[StepInfo], step: int) -> list[int]:
    """The pinned steps of ``listing`` after ``step``, in order (pure)."""
    return sorted(i.step for i in listing if i.step > step and i.pinned)


def check_pins(listing: Sequence[StepInfo], step: int, url: str, pinned: Sequence[int] | None = None) -> None:
    """Before a rollback to ``step`` removes anything: CheckpointExistsError when a step after it is pinned
    (``pinned``: those steps, already found; else found in ``listing``)."""
    pinned = pinned_after(listing, step) if pinned is None else list(pinned)
    if pinned:
        raise CheckpointExistsError(
            f"{url}: the run goes on from step {step} (restore(state, step={step})), which removes the steps after "
            f"it, but step(s) {pinned} are pinned; unpin them (mgr.unpin) or copy them elsewhere first")


def forget_after(storage: Storage, step: int, listing: Sequence[StepInfo]) -> list[int]:
    """Delete every step of ``listing`` (the steps under the root or tier ``storage``) newer than ``step``, of any
    status, newest first (a step before the ones it references); return them. A pinned one among them raises
    CheckpointExistsError first, deleting nothing."""
    check_pins(listing, step, storage.url)
    newer = sorted((i.step for i in listing if i.step > step), reverse=True)
    for s in newer:
        delete_step(storage, s)
    return newer


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


__all__ = ["Branches", "check_order", "check_pins", "check_step", "forget_after", "live", "pinned_after"]
