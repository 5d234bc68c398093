"""``ls`` and ``gc`` of a CheckpointManager root, without a training job (docs/cli/ls.md, docs/cli/gc.md)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from liferaft.errors import LiferaftError, OptionsError
from liferaft.manager.lease import Lease
from liferaft.manager.listing import (
    StepInfo,
    delete_step,
    foreign_steps,
    kept_steps,
    list_steps,
    read_branches,
    read_pins,
    root_names,
    step_like,
    step_name,
)
from liferaft.manager.policies import RetentionPolicy
from liferaft.manager.rollback import live
from liferaft.options import MetricMode
from liferaft.storage import Storage, resolve


def _pins(storage: Storage) -> frozenset[int]:
    """The pins ``ls`` shows: none when ``PINS`` is damaged (``gc`` refuses then: ``read_pins``; ``ls`` with
    ``check_pins`` raises too)."""
    try:
        return read_pins(storage)
    except LiferaftError:
        return frozenset()


def _root(root: str | os.PathLike[str] | Storage) -> Storage:
    """The storage of a manager root; a path that is itself a checkpoint (of any format) is refused, naming it."""
    from liferaft.formats.detect import NAMES, detect_names, sniff
    from liferaft.options import check_path

    check_path(root, "root")
    if isinstance(root, (str, os.PathLike)) and "://" not in os.fspath(root):
        if not os.path.lexists(os.fspath(root)):
            from liferaft.errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"{os.fspath(root)}: no such folder; ls and gc take the folder holding "
                                          "step-N folders (a CheckpointManager root)")
        if not os.path.isdir(os.fspath(root)) and not os.path.isfile(os.fspath(root)):
            raise OptionsError(f"{os.fspath(root)}: not a folder (a FIFO, a device or a link to one); ls and gc "
                               "take the folder holding step-N folders (a CheckpointManager root)")
        fmt = sniff(root)
        if fmt is not None and fmt != "liferaft" or os.path.isfile(os.fspath(root)):
            raise OptionsError(f"{os.fspath(root)}: a {NAMES[fmt or 'torch']}, not a CheckpointManager root (ls "
                               "and gc take the folder holding step-N folders); inspect, verify, read, diff and "
                               "convert take a checkpoint")
    storage = resolve(root)
    names = root_names(storage)[0]
    if detect_names(names) is not None and not any(step_like(n) is not None for n in names):
        raise OptionsError(f"{storage.url}: a liferaft checkpoint, not a CheckpointManager root (ls and gc take "
                           "the folder holding step-N folders); inspect, verify, read, diff and convert take a "
                           "checkpoint")
    return storage


def _listing(storage: Storage, pins: frozenset[int], verify: bool = False,
             progress: Callable[[int], None] | None = None) -> list[StepInfo]:
    """``list_steps``, with step folders that hold a checkpoint of another format (torchtitan's ``step-N`` DCP
    folders, say, under their own names) given that format as their status instead of "incomplete": restore skips
    them, gc leaves them. A folder named ``step-<digits>`` otherwise but not canonically (``step-5``) is listed
    "corrupt", saying so (unless the canonical folder of that step is there): never restored nor deleted. One bad
    step never hides the others: what fails there is that step's status."""
    from liferaft.formats.detect import NAMES, detect_names

    by_folder: dict[str, list[str]] = {}
    names = root_names(storage)[0]
    for name in names:
        head, _, rest = name.partition("/")
        if rest and step_like(head) is not None:
            by_folder.setdefault(head, []).append(rest)
    foreign: dict[int, tuple[str, str]] = {}
    odd: dict[int, str] = {}
    for head, rest in by_folder.items():
        fmt, step = detect_names(rest), step_like(head)
        if step is None or (head != step_name(step) and step_name(step) in by_folder):
            continue                                    # (the canonical folder of that step is the step)
        if fmt not in (None, "liferaft"):
            foreign[step] = (head, fmt)
        elif head != step_name(step):
            odd[step] = head
    out = {i.step: i for i in list_steps(storage, pins, verify, progress)}
    for step, head in odd.items():
        out.setdefault(step, StepInfo(step, storage.child(head).url, "corrupt",
                                      f"{head} is not a step folder name liferaft writes ({step_name(step)}): "
                                      "never restored nor deleted by liferaft; rename it if it is that step",
                                      pinned=step in pins))
    for step, (head, fmt) in foreign.items():
        info = out.get(step)
        if info is not None and info.status == "committed":
            continue
        pinned = step in pins
        try:                                # (one bad step never hides the others: its fault is its status)
            nbytes = sum(storage.size(f"{head}/{rest}") for rest in by_folder[head])
        except (LiferaftError, OSError) as e:
            out[step] = StepInfo(step, storage.child(head).url, "corrupt",
                                 f"looks like a {NAMES[fmt]} ({head}) but {e or type(e).__name__}: not written by "
                                 "liferaft; restore skips it and gc leaves it", pinned=pinned)
        else:
            out[step] = StepInfo(step, storage.child(head).url, fmt,
                                 f"a {NAMES[fmt]} ({head}), not written by liferaft: inspect, verify, read, diff "
                                 "and convert take it; restore skips it and gc leaves it", pinned=pinned,
                                 nbytes=nbytes)
    for step, rest in foreign_steps(names).items():
        info = out.get(step)
        if info is not None and info.status == "incomplete":
            out[step] = replace(info, reason=f"no commit marker, and holds files liferaft does not write ({rest[:80]!r}"
                                             "...): not a leftover of a save; gc leaves it")
    return [out[step] for step in sorted(out)]


def ls(root: str | os.PathLike[str] | Storage, verify: bool = False,
       progress: Callable[[int], None] | None = None, *, check_pins: bool = False) -> list[StepInfo]:
    """Every step under the manager root, oldest first, with status, bytes, writer and references (reads only;
    ``verify`` re-hashes every committed step, calling ``progress`` with the bytes of each read). A step folder
    holding another format's checkpoint has that format as its status ("dcp", ...); a root that is itself a
    checkpoint is refused (OptionsError), a local root that does not exist too (CheckpointNotFoundError). A
    damaged ``PINS`` shows no step pinned, or with ``check_pins`` raises the CorruptCheckpointError naming it
    that ``gc`` and the manager raise (the CLI lists the steps, then reports it and exits 1)."""
    storage = _root(root)
    if check_pins:
        read_pins(storage)
    return _listing(storage, _pins(storage), verify, progress)


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` deleted (or, with ``dry_run``, would delete): the steps, the committed steps kept, and the bytes
    freed."""

    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    freed_bytes: int
    dry_run: bool


def gc(root: str | os.PathLike[str] | Storage, *, keep_last: int | None = None, keep_every: int | None = None,
       keep_best: int | None = None, metric: str | None = None, mode: MetricMode = "min", dry_run: bool = False,
       incomplete: bool = False, on_wait: Callable[[str], None] | None = None) -> GcReport:
    """The manager's retention from outside a job: delete committed steps the policy does not keep, never the
    newest committed one of the root's run (a step a rollback abandoned, ``BRANCHES``, is never ranked: it goes), a
    pinned one or one a kept step references (and, with ``incomplete``, steps without a
    commit marker that nothing references; never a step folder holding another format's checkpoint, nor one
    holding any file liferaft never writes there: a ``torch.save`` file, a user's notes). Takes the
    root's lease first, so it refuses
    (CheckpointBusyError) while a training job writes there (waiting first up to the holder's ttl, bounded:
    ``on_wait(message)`` says so when the wait begins). Deletion is marker-first, as the manager's. A ``metric``
    no committed step records is refused (OptionsError, nothing deleted: a typo would keep only the newest), and so
    is a call with no policy and not ``incomplete`` (it would delete nothing)."""
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric,
                             mode=mode)
    if not policy.deletes_anything and not incomplete:
        raise OptionsError("gc: no policy given (keep_last, keep_every or keep_best; or incomplete=True for the "
                           "leftovers of interrupted saves): it would delete nothing")
    storage = _root(root)
    lease = None if dry_run else Lease(storage, job_id=f"liferaft-gc:{uuid.uuid4().hex}")
    unguard: Callable[[], None] = lambda: None
    if lease is not None:
        lease.acquire(on_wait)
        unguard = lease.guard()       # (each deletion checks the lease first)
    try:
        pins = read_pins(storage)                               # (a damaged PINS refuses: nothing deleted)
        branches = read_branches(storage)                       # (a damaged BRANCHES too)
        listing = _listing(storage, pins)                       # (steps of other formats: never deleted)
        committed = [i.step for i in listing if i.status == "committed"]
        if metric is not None and committed and not any(metric in (i.metrics or {}) for i in listing):
            # (offline, every step's metrics are known: a name none records is a typo, which would delete all
            # but the newest; a running manager's later steps may still record it)
            named = sorted({k for i in listing for k in (i.metrics or {})})
            raise OptionsError(f"gc: no committed step under {storage.url} records the metric {metric!r} (they "
                               f"record: {', '.join(map(repr, named[:10])) or 'none'}); nothing was deleted")
        keep = kept_steps(listing, policy, pins, ranked=lambda i: live(i.step, i.epoch, branches))
        doomed = [i for i in listing if i.status == "committed" and i.step not in keep]
        if incomplete:              # (never a folder holding files liferaft does not write: as the manager's start)
            foreign = foreign_steps(root_names(storage)[0])
            doomed += [i for i in listing if i.status == "incomplete" and i.step not in keep and i.step not in foreign]
        if not dry_run:                                         # (reported: only what was there and removed)
            doomed = [info for info in doomed if delete_step(storage, info.step)]
        freed = sum(i.nbytes for i in doomed)
        return GcReport(deleted=tuple(i.step for i in doomed), kept=tuple(sorted(keep & set(committed))),
                        freed_bytes=freed, dry_run=dry_run)
    finally:
        unguard()
        if lease is not None:
            lease.release()
