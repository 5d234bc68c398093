"""``ls`` and ``gc`` of a CheckpointManager root, without a training job (docs/cli/ls.md, docs/cli/gc.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from liferaft.manager.lease import Lease
from liferaft.manager.manager import PINS, StepInfo, list_steps, step_name
from liferaft.manager.policies import RetentionPolicy, referenced_closure
from liferaft.storage import Storage, resolve
from liferaft.format.manifest import COMMIT_MARKER


def _pins(storage: Storage) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in json.loads(storage.read_all(PINS)))
    except (FileNotFoundError, ValueError, TypeError):
        return frozenset()


def ls(root: str | os.PathLike[str] | Storage, verify: bool = False,
       progress: Callable[[int], None] | None = None) -> list[StepInfo]:
    """Every step under the manager root, oldest first, with status, bytes, writer and references (reads only;
    ``verify`` re-hashes every committed step, calling ``progress`` with the bytes of each read)."""
    storage = resolve(root)
    return list_steps(storage, _pins(storage), verify, progress)


@dataclass(frozen=True)
class GcReport:
    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    freed_bytes: int
    dry_run: bool


def gc(root: str | os.PathLike[str] | Storage, *, keep_last: int | None = None, keep_every: int | None = None,
       keep_best: int | None = None, metric: str | None = None, mode: str = "min", dry_run: bool = False,
       incomplete: bool = False) -> GcReport:
    """The manager's retention from outside a job: delete committed steps the policy does not keep, never the
    newest committed one, a pinned one or one a kept step references (and, with ``incomplete``, steps without a
    commit marker that nothing references). Takes the root's lease first, so it refuses
    (CheckpointBusyError) while a training job writes there. Deletion is marker-first, as the manager's."""
    storage = resolve(root)
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric,
                             mode=mode)
    lease = None if dry_run else Lease(storage, job_id="liferaft-gc")
    if lease is not None:
        lease.acquire()
    try:
        listing = list_steps(storage, _pins(storage))
        committed = [i.step for i in listing if i.status == "committed"]
        keep = set(policy.keep(committed, {i.step: i.metrics for i in listing if i.metrics}, _pins(storage)))
        keep = referenced_closure(keep, {i.step: i.depends_on for i in listing})
        doomed = [i for i in listing if i.status == "committed" and i.step not in keep]
        if incomplete:
            doomed += [i for i in listing if i.status == "incomplete" and i.step not in keep]
        freed = sum(i.nbytes for i in doomed)
        if not dry_run:
            for info in doomed:
                prefix = step_name(info.step) + "/"
                storage.delete(prefix + COMMIT_MARKER)
                for name in storage.list():
                    if name.startswith(prefix):
                        storage.delete(name)
        return GcReport(deleted=tuple(i.step for i in doomed), kept=tuple(sorted(keep & set(committed))),
                        freed_bytes=freed, dry_run=dry_run)
    finally:
        if lease is not None:
            lease.release()
