"""The steps under a manager root: their names (``step-<step, 10 digits>``), what each holds and whether it is
committed, incomplete or corrupt; the pins. No collective; only ``delete_step``, ``remove_leftovers`` and
``write_pins`` write (rank 0, holding the lease)."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from liferaft.core.commit import check_files, check_guards, open_checkpoint
from liferaft.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LiferaftError,
    StorageError,
)
from liferaft.format import jsonsafe
from liferaft.format.layout import (  # noqa: F401 - step_like: for tools.steps
    COMMIT_MARKER,
    STEP_PREFIX,
    is_layout_name,
    is_probe_name,
    parse_step,
    step_like,
    step_name,
)
from liferaft.format.limits import MAX_INT, MAX_ROOT_FILE_BYTES
from liferaft.manager.policies import RetentionPolicy, referenced_closure
from liferaft.storage import Storage
from liferaft.storage.refs import with_references

_parse_step = parse_step
PINS = "PINS"                  # the steps the user pinned (a JSON list) under the root
#: the newest step a manager of the root began to save (JSON, rank 0 writes it before the save starts): a restore
#: that finds the memory tier holding a step at least that new needs no listing of the root or the remote tier
INTENT = "INTENT"
#: the rollbacks of the root, in order (JSON ``[[epoch, step], ...]``, rank 0 writes it before a rollback removes
#: anything): the run of epoch e went back to ``step``, so the steps after it saved in earlier epochs are abandoned
#: (``rollback.live``), wherever a copy of them is left (a node that missed the rollback, an interrupted removal)
BRANCHES = "BRANCHES"


@dataclass(frozen=True)
class StepInfo:
    """One step under the root. ``status``: "committed", "incomplete" (no commit marker: a save that did not
    finish, or one in flight) or "corrupt" (``reason`` says why)."""

    step: int
    path: str
    status: str
    reason: str = ""
    nbytes: int = 0
    created_unix: float | None = None
    world_size: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    pinned: bool = False
    depends_on: tuple[int, ...] = ()       # steps holding chunks this one references (incremental saves)
    tiers: tuple[str, ...] = ()            # where a committed copy is: "root", "memory" (this node's namespace)
    job_id: str | None = None              # the job that wrote it
    since_full: int | None = None          # saves since the last full (self-contained) one; 0: this is one
    epoch: int = 0                         # the root's rollbacks before its save (``BRANCHES``; 0 before any)



def list_steps(storage: Storage, pins: frozenset[int] = frozenset(), deep: bool = False,
               progress: Callable[[int], None] | None = None) -> list[StepInfo]:
    """Every step under the manager root ``storage``, oldest first, with its status (committed / incomplete /
    corrupt and why), own bytes, writer, metrics and the steps it references; ``deep`` re-hashes committed steps
    (``progress`` is called with the bytes of each read). Reads only (no lease, no collective). A step's manifest
    is read and checked, and its files found at their sizes; the chunk tables of a version 4 step are read only
    with ``deep`` (a load of a step whose table is damaged fails, and ``restore`` takes the step before)."""
    names, unlisted = _step_names(storage)
    out = []
    for step in sorted({*names, *unlisted}):
        st = with_references(storage.child(step_name(step)))
        path, pinned = st.url, step in pins
        if step in unlisted:
            out.append(StepInfo(step, path, "corrupt", unlisted[step], pinned=pinned))
            continue
        if step_name(step) in names[step]:              # the entry itself: a file, a link, a FIFO, not a folder
            out.append(StepInfo(step, path, "corrupt", f"{path} is not a folder (a file, a link or a special file "
                                "where a step folder belongs): not a step liferaft wrote; never restored nor "
                                "deleted by liferaft: remove it by hand if it is not needed", pinned=pinned))
            continue
        if f"{step_name(step)}/{COMMIT_MARKER}" not in names[step]:
            out.append(StepInfo(step, path, "incomplete", "no commit marker", pinned=pinned))
            continue
        try:
            m = open_checkpoint(st, tables=False)       # (a version 4 step's tables: read by a load or verify)
            recorded = m.extra.get("step")
            if type(recorded) is int and recorded != step:
                raise CorruptCheckpointError(f"{path}: its manifest records step {recorded}, the folder says {step} "
                                             "(a step folder renamed or copied into place): never restored as "
                                             f"step {step}")
            check_files(st, m, m.files)
            if deep:
                from liferaft.core.read import verify

                verify(st, progress=progress)
        except (LiferaftError, OSError) as e:            # (one bad step never hides the others)
            out.append(StepInfo(step, path, "corrupt", str(e) or type(e).__name__, pinned=pinned))
            continue
        raw = m.extra.get("metrics") if isinstance(m.extra.get("metrics"), dict) else {}
        # (what a manager writes: finite numbers by name; anything else in a manifest is no metric to rank by)
        metrics = {k: v for k, v in raw.items() if type(k) is str and type(v) in (int, float) and math.isfinite(v)}
        since = m.extra.get("since_full")
        out.append(StepInfo(step, path, "committed", nbytes=sum(v for k, v in m.files.items() if k[:3] != "../"),
                            created_unix=m.created_unix, world_size=m.world_size, metrics=dict(metrics),
                            pinned=pinned, depends_on=_references(m.files),
                            since_full=since if type(since) is int else None, epoch=epoch_of(m.extra),
                            job_id=str(m.extra["job_id"]) if "job_id" in m.extra else None, tiers=("root",)))
    return out


def root_names(storage: Storage) -> tuple[list[str], dict[int, str]]:
    """(every name under the root, {step: why its folder cannot be listed}). When the root cannot be listed whole
    (S3: a key there the client cannot name) but its folders can be listed one by one (``folders``), each step
    folder is listed alone: a step that still cannot be is reported, never hiding the others."""
    try:
        return storage.list(), {}
    except StorageError:
        folders = getattr(storage, "folders", None)
        if folders is None:
            raise
    listed: list[str] = []
    unlisted: dict[int, str] = {}
    for head in folders():
        step = _parse_step(head)
        if step is None:
            continue
        try:
            listed += (f"{head}/{n}" for n in storage.child(head).list())
        except StorageError as e:
            unlisted[step] = str(e)
    return listed, unlisted


def _step_names(storage: Storage) -> tuple[dict[int, list[str]], dict[int, str]]:
    """({step: the names of its folder}, {step: why its folder cannot be listed}) (``root_names``)."""
    listed, unlisted = root_names(storage)
    names: dict[int, list[str]] = {}
    for name in listed:
        step = _parse_step(name)
        if step is not None:
            names.setdefault(step, []).append(name)
    return names, unlisted


def foreign_steps(names: Iterable[str]) -> dict[int, str]:
    """Steps under a root that hold a file liferaft never writes in a step folder (a DCP or torchtitan folder
    under the same name, a user's file), each with one such name: cleaning up never deletes those."""
    out: dict[int, str] = {}
    for name in names:
        step, _, rest = name.partition("/")
        n = _parse_step(step)
        if n is None or not rest or n in out:
            continue
        if not is_layout_name(rest):
            out[n] = rest
    return out


def _references(files: Mapping[str, int]) -> tuple[int, ...]:
    """The steps whose files a manifest's ``files`` table references (``../step-<n>/...``)."""
    out = set()
    for name in files:
        if name.startswith("../"):
            step = _parse_step(name[3:])
            if step is not None:
                out.add(step)
    return tuple(sorted(out))


def read_pins(storage: Storage) -> frozenset[int]:
    """The pinned steps under the root ``storage`` (none when there is no ``PINS``). Raises
    CorruptCheckpointError naming the file when it is not a JSON list of steps (integers in ``[0, 2**63)``)."""
    where = f"{storage.url}/{PINS}"
    advice = "fix it or delete it (it lists the pinned steps; unpin and pin again)"
    try:
        raw = storage.read_all(PINS, MAX_ROOT_FILE_BYTES)
    except FileNotFoundError:
        return frozenset()
    doc = jsonsafe.loads(raw, where, MAX_ROOT_FILE_BYTES, advice=advice)
    if not isinstance(doc, list) or not all(type(s) is int and 0 <= s <= MAX_INT for s in doc):
        raise CorruptCheckpointError(f"{where}: not a JSON list of steps (integers from 0 to 2**63 - 1); {advice}")
    return frozenset(doc)


def read_intent(storage: Storage) -> int | None:
    """The step ``INTENT`` under the root holds: the newest step a manager of this root began to save (to the root,
    or drained to the remote tier) in the root's current epoch; None if there is none or it does not hold
    (unreadable, not strict JSON, not ``{"format": 1, "step": <int in [0, 2**63)>}``, a link or not a regular file
    on a local root): no record, so the caller lists instead. Never raises."""
    got = read_intent_at(storage)
    return None if got is None else got[0]


def read_intent_at(storage: Storage) -> tuple[int, int | None] | None:
    """``INTENT``'s (step, epoch): the epoch (the root's rollbacks, ``BRANCHES``) its step was begun in, None when it
    records none (written before epochs were) or none that holds; None as ``read_intent``. Never raises."""
    try:
        raw = storage.read_all(INTENT, MAX_ROOT_FILE_BYTES)
        doc = jsonsafe.loads(raw, f"{storage.url}/{INTENT}", MAX_ROOT_FILE_BYTES)
    except (OSError, LiferaftError, ValueError):
        return None
    step = doc.get("step") if isinstance(doc, dict) and doc.get("format") == 1 else None
    if type(step) is not int or not 0 <= step <= MAX_INT:
        return None
    epoch = doc.get("epoch")
    return step, epoch if type(epoch) is int and 0 <= epoch <= MAX_INT else None


def _guarded(storage: Storage, name: str) -> None:
    """Before rank 0 writes ``name`` under the root: the guards of the root (``core.commit.guard_commits``: the
    lease of the manager holding it) pass, or CheckpointBusyError (a job that lost the root writes nothing there)."""
    check_guards(storage.url.rstrip("/") + "/" + name)


def write_intent(storage: Storage, step: int, epoch: int = 0) -> None:
    """Rank 0, holding the lease, before a save of ``step`` starts in ``epoch``: record it in ``INTENT``
    (atomically replaced)."""
    _guarded(storage, INTENT)
    storage.put_atomic(INTENT, json.dumps({"format": 1, "step": int(step), "epoch": int(epoch)}).encode())


#: the key of a manifest's ``extra`` under which the manager records the root's rollbacks before the save (its
#: own: a user's ``SaveOptions.metadata`` may well say ``epoch``)
EPOCH_KEY = "liferaft_rollbacks"
#: the manifest ``extra`` key of a manager's memory-tier saves naming the root they belong to (``owner_id`` of the
#: root's URL, as rank 0 names it): a memory tier shared by two managers (one job id, two experiments on a node)
#: never gives one the other's steps
ROOT_KEY = "liferaft_root"


def epoch_of(extra: Mapping[str, object]) -> int:
    """The epoch a manifest's ``extra`` records (0: none, or not an integer in range: a save before rollbacks)."""
    e = extra.get(EPOCH_KEY)
    return e if type(e) is int and 0 <= e <= MAX_INT else 0


def read_branches(storage: Storage) -> tuple[tuple[int, int], ...]:
    """The root's rollbacks (``BRANCHES``): ((epoch, step), ...), epochs 1, 2, ... in order; () when there is none.
    CorruptCheckpointError naming the file when it is anything else (a save or restore must not guess which steps
    are abandoned)."""
    where = f"{storage.url}/{BRANCHES}"
    try:
        raw = storage.read_all(BRANCHES, MAX_ROOT_FILE_BYTES)
    except FileNotFoundError:
        return ()
    doc = jsonsafe.loads(raw, where, MAX_ROOT_FILE_BYTES)
    ok = isinstance(doc, list) and all(isinstance(b, list) and len(b) == 2 and type(b[0]) is int
                                       and type(b[1]) is int and b[0] == i + 1 and 0 <= b[1] <= MAX_INT
                                       for i, b in enumerate(doc))
    if not ok:
        raise CorruptCheckpointError(f"{where}: not the root's list of rollbacks ([[1, step], [2, step], ...]); it "
                                     "is damaged: restore it from a copy, or delete it only if no run of this root "
                                     "was ever rolled back (restore(state, step=K))")
    return tuple((e, k) for e, k in doc)


def write_branches(storage: Storage, branches: Iterable[tuple[int, int]]) -> None:
    """Rank 0, holding the lease, before a rollback removes anything: record ``branches`` (atomically replaced)."""
    _guarded(storage, BRANCHES)
    storage.put_atomic(BRANCHES, json.dumps([list(b) for b in branches]).encode())


def write_pins(storage: Storage, pins: Iterable[int]) -> None:
    _guarded(storage, PINS)
    storage.put_atomic(PINS, json.dumps(sorted(pins)).encode())


def delete_step(storage: Storage, step: int) -> bool:
    """Delete the step folder of ``step`` under the root ``storage`` (its canonical name ``step_name(step)``, every
    name liferaft writes in it: a link is removed, never followed): marker first, so that a crash halfway leaves
    an incomplete step (removed at the next start), never a committed step with missing files. A file liferaft
    never writes there (a user's notes) stays, and with it the folder, no longer a checkpoint (``ls`` lists it
    as incomplete; the starts after leave it, with their warning about such folders). No warning here: raised as
    an error, it would stop a rollback half way. Whether anything of liferaft's was there to delete (an entry of
    that name that is not a folder is never touched: False). The guards registered for the root
    (``core.commit.guard_commits``: the lease of the manager or ``gc`` holding it) run first: a process that lost the
    root to another job deletes nothing there (CheckpointBusyError)."""
    prefix = step_name(step) + "/"
    check_guards(storage.url.rstrip("/") + "/" + prefix)
    names = [name for name in storage.list() if name.startswith(prefix)]
    if prefix + COMMIT_MARKER in names:
        storage.delete(prefix + COMMIT_MARKER)
    ours = [name for name in names if is_layout_name(name[len(prefix):])]
    for name in ours:
        if name != prefix + COMMIT_MARKER:
            storage.delete(name)           # (through the root: empty folders go too)
    return bool(ours)


def remove_leftovers(storage: Storage, listing: list[StepInfo], warn: Callable[[str], None] | None = None) -> None:
    """Rank 0, holding the lease: remove steps of saves that never committed (no job writes them now) — not one
    that committed steps reference, nor one holding files liferaft never writes (warnings say so, through ``warn``
    if given) — and, when a step is incomplete, the files killed I/O probes left under the root
    (``format.layout.is_probe_name``)."""
    def say(text: str) -> None:
        if warn is not None:
            warn(text)
        else:
            warnings.warn(text, stacklevel=4)

    needed = {d for i in listing if i.status == "committed" for d in i.depends_on}
    # the whole root is listed only when a step is incomplete (a big root, or an S3 prefix holding a key the
    # client cannot name, is not walked at every start); a killed probe's file elsewhere is no data anyway
    names = storage.list() if any(i.status == "incomplete" for i in listing) else []
    for name in names:
        if is_probe_name(name):            # a killed I/O probe's file (in use by a live probe: it reads and writes
            storage.delete(name)           # through its descriptor, so removing the name harms nothing)
    foreign = foreign_steps(names) if names else {}
    for info in listing:
        if info.status == "incomplete" and info.step in needed:
            say(f"liferaft: step {info.step} has no commit marker but committed steps reference its chunks; keeping "
                "its files")
        elif info.status == "incomplete" and info.step in foreign:
            say(f"liferaft: {info.path} has no commit marker but holds files liferaft does not write "
                f"({foreign[info.step]!r}...): not a leftover of an interrupted save; leaving it")
        elif info.status == "incomplete":
            delete_step(storage, info.step)


def kept_steps(listing: list[StepInfo], policy: RetentionPolicy, pins: frozenset[int],
               metrics: Mapping[int, Mapping[str, float]] | None = None, protect: Iterable[int] = (),
               ranked: Callable[[StepInfo], bool] = lambda _: True) -> set[int]:
    """The steps retention keeps: what ``policy`` keeps of the committed steps ``ranked`` says are the run's (by
    the metrics their manifests record, overridden by ``metrics``; a step a rollback abandoned is never the
    newest), the pinned ones, ``protect`` (being written or read), and every step a kept one references (pure)."""
    committed = [i.step for i in listing if i.status == "committed" and ranked(i)]
    recorded = {i.step: i.metrics for i in listing if i.metrics}
    pinned = pins & {i.step for i in listing}
    keep = set(policy.keep(committed, {**recorded, **(metrics or {})}, pins)) | pinned | set(protect)
    return referenced_closure(keep, {i.step: i.depends_on for i in listing})


def apply_retention(storage: Storage, policy: RetentionPolicy, metrics: Mapping[int, Mapping[str, float]],
                    protect: Iterable[int], ranked: Callable[[StepInfo], bool] = lambda _: True,
                    spare: Iterable[int] = ()) -> list[int]:
    """Rank 0, holding the lease: delete the committed steps under the root ``storage`` that ``policy`` does not
    keep (``kept_steps``: the pinned ones, ``protect`` and what a kept step references stay); return them. Only the
    steps ``ranked`` says are the run's take part in the policy (an abandoned step is deleted, never kept as the
    newest); ``spare``: steps neither ranked nor deleted (damaged ones a restore skipped: removed by hand)."""
    pins = read_pins(storage)
    spared = set(spare)
    listing = [i for i in list_steps(storage, pins) if i.step not in spared]
    keep = kept_steps(listing, policy, pins, metrics, protect, ranked)
    gone = [i.step for i in listing if i.status == "committed" and i.step not in keep]
    for step in gone:
        delete_step(storage, step)
    return gone


def lossy_state_of(copies: Iterable[Storage]) -> str | None:
    """The ``lossy_state`` a step recorded (``CheckpointManager.mark_lossy``), from the first of its ``copies``
    that opens; None if none records one."""
    for st in copies:
        try:
            found = open_checkpoint(st).extra.get("lossy_state")
        except (LiferaftError, OSError):
            continue
        return found if isinstance(found, str) else None
    return None


def restore_candidates(listing: list[StepInfo], step: int | None, url: str,
                       ranked: Callable[[StepInfo], bool] = lambda _: True) -> list[StepInfo]:
    """The committed steps to try to restore, newest first: every one (corrupt ones are skipped with a warning),
    or exactly ``step`` (CheckpointNotFoundError, IncompleteCheckpointError or CorruptCheckpointError if it
    cannot be). Only the steps ``ranked`` says are the run's (``rollback.live``): an abandoned one is skipped, or
    refused when asked for by number (CheckpointNotFoundError)."""
    gone = [i for i in listing if not ranked(i)]
    listing = [i for i in listing if ranked(i)]
    if step is None:
        for info in reversed(listing):
            if info.status == "corrupt":
                warnings.warn(f"liferaft: skipping step {info.step} ({info.path}): {info.reason}", stacklevel=3)
        return [i for i in reversed(listing) if i.status == "committed"]
    if any(i.step == step for i in gone):
        raise CheckpointNotFoundError(f"{url}: step {step} belongs to a run the root rolled back from (its "
                                      "BRANCHES): it is abandoned, not restored")
    match = [i for i in listing if i.step == step]
    if not match:
        raise CheckpointNotFoundError(f"{url}: there is no step {step}; steps: {[i.step for i in listing]}")
    if match[0].status != "committed":
        cls = IncompleteCheckpointError if match[0].status == "incomplete" else CorruptCheckpointError
        raise cls(f"{url}: step {step} cannot be restored ({match[0].reason})")
    return match


__all__ = [
    "BRANCHES",
    "EPOCH_KEY",
    "INTENT",
    "PINS",
    "ROOT_KEY",
    "STEP_PREFIX",
    "StepInfo",
    "apply_retention",
    "delete_step",
    "epoch_of",
    "kept_steps",
    "list_steps",
    "lossy_state_of",
    "read_branches",
    "read_intent",
    "read_intent_at",
    "read_pins",
    "remove_leftovers",
    "restore_candidates",
    "step_name",
    "write_branches",
    "write_intent",
    "write_pins",
]
