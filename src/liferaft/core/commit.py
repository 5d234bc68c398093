"""The commit protocol of one native checkpoint, and the only place that knows its file names.

A checkpoint at a storage root is: data files ``data/<save id>/r<rank>.bin`` (written by each rank), one manifest
``manifest-<save id>.json`` (written by rank 0 once every rank's data is durable) and the marker ``COMMIT`` naming
that manifest with its size and checksum, put atomically last: the checkpoint exists from that moment and never
before. After a commit, files of other saves (the replaced checkpoint, interrupted saves) are removed. The save
path, the memory tier, the manager and the tools all go through these functions (docs/FORMAT.md §8).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

from liferaft.codecs import registry as codec_registry
from liferaft.codecs.checksum import digest
from liferaft.core.caches import PlanCache
from liferaft.errors import (
    CheckpointBusyError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidStateError,
    LiferaftError,
    UnsafePathError,
)
from liferaft.format.checks import tree_problem
from liferaft.format.jsonsafe import paused_gc
from liferaft.format.layout import COMMIT_MARKER, DATA_DIR, is_stale, manifest_name
from liferaft.format.limits import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES
from liferaft.format.manifest import (
    ChunkRecord,
    CommitMarker,
    Manifest,
    TableRef,
    decode_commit_marker,
    decode_manifest,
)
from liferaft.format.tables import decode_table
from liferaft.planning.geometry import check_chunks_tile
from liferaft.storage import Storage


@dataclass(frozen=True)
class CommitRecord:
    """The bytes that make a checkpoint committed: its manifest (name and bytes) and the marker naming it. A
    committed checkpoint copied elsewhere (the memory tier's nodes, a drain to disk) is committed there by
    :func:`publish_commit` of its record once its data files are there."""

    marker: bytes
    manifest_name: str
    manifest: bytes


def write_commit(storage: Storage, save_id: str, manifest: Manifest) -> CommitRecord:
    """Write ``manifest`` for ``save_id``, make it durable, then put the ``COMMIT`` marker naming it atomically:
    the checkpoint exists once this returns (rank 0, after every rank's data is durable). A manifest whose
    saved tree a reader would refuse (``format.checks.tree_problem``: ranks whose states conflict) raises
    InvalidStateError instead: nothing is committed, and the checkpoint it would replace stays."""
    problem = tree_problem(manifest.tensors, manifest.values, manifest.containers)
    if problem:
        raise InvalidStateError(f"{storage.url}: the ranks' states conflict: {problem}; nothing was committed")
    for sibling in sorted({f[3:].partition("/")[0] for f in manifest.files if f.startswith("../")}):
        if same_place(storage, sibling):    # (its old files go with this commit: never reference them)
            raise InvalidStateError(f"{storage.url}: the save would reference files of {sibling!r}, which is this "
                                    "checkpoint itself; nothing was committed")
    if any(f.startswith("../") for f in manifest.files):
        try:                        # (the base may have been replaced or removed while this save ran)
            check_references(storage, manifest)
        except UnsafePathError as e:
            raise CheckpointBusyError(f"{storage.url}: the checkpoint this incremental save references changed "
                                      f"while it ran (replaced or removed): {e}; nothing was committed. Save again "
                                      "(a full save, or against a base nobody replaces meanwhile)") from None
    data = manifest.to_json_bytes()
    name = manifest_name(save_id)
    marker = CommitMarker(manifest=name, manifest_size=len(data), manifest_hash=digest(data),
                          version=manifest.needs_version())
    record = CommitRecord(marker.to_json_bytes(), name, data)
    publish_commit(storage, record)
    if manifest.tabled:     # (what ``decode_manifest`` makes of these bytes: tests/multiproc/test_own_incremental.py)
        INDEXES.put((storage.url, marker.manifest_hash, len(data), codec_registry.names()),
                    replace(manifest, version=max(manifest.version, manifest.needs_version()),
                            extra=json.loads(json.dumps(manifest.extra))))
    return record


#: Checks run right before a commit marker is put under a folder, and before a step under it is deleted
#: (``check_guards``; ``manager.listing.delete_step``): (folder URL, check) by a token; one passing is enough. A
#: ``CheckpointManager`` (and ``liferaft gc``) registers its lease's check for its root (``guard_commits``): a job
#: that lost the root to another job (frozen longer than its lease's ttl, say) commits and deletes nothing there,
#: even in a save or a retention pass already running.
_GUARDS: dict[object, tuple[str, Callable[[], None]]] = {}
_GUARDS_LOCK = threading.Lock()


def guard_commits(folder_url: str, check: Callable[[], None]) -> Callable[[], None]:
    """Run ``check`` (it raises to refuse) before every commit under ``folder_url`` in this process, until the
    returned function is called."""
    token = object()
    with _GUARDS_LOCK:
        _GUARDS[token] = (folder_url.rstrip("/") + "/", check)

    def stop() -> None:
        with _GUARDS_LOCK:
            _GUARDS.pop(token, None)
    return stop


def check_guards(url: str) -> None:
    """Raise what the guards of the folders above ``url`` (``guard_commits``) raise, unless one passes (none
    registered: pass). Called before anything under ``url`` is committed or deleted."""
    _guarded(_checks_of(url))


def _checks_of(url: str) -> list[Callable[[], None]]:
    with _GUARDS_LOCK:
        return [c for prefix, c in _GUARDS.values() if url.startswith(prefix)]


def publish_commit(storage: Storage, record: CommitRecord) -> None:
    """Put the manifest, make it durable, then put the marker atomically (every data file must be there); the
    guards of the folders above it (``guard_commits``) run first, again right before the marker and once after it
    (a guard failing then raises, the marker put)."""
    checks = _checks_of(storage.url)
    _guarded(checks)
    storage.put_atomic(record.manifest_name, record.manifest)
    storage.sync()
    _guarded(checks)
    storage.put_atomic(COMMIT_MARKER, record.marker)
    # (and once after: a process stopped between the check and the marker for longer than its lease's ttl may have
    # put it over a newcomer's; raising here keeps the save from removing the files its manifest does not name)
    _guarded(checks)


def _guarded(checks: list[Callable[[], None]]) -> None:
    """Pass if there is no check or one passes (two managers of one job in this process: the one holding the
    lease now vouches); else raise the first one's error."""
    first: BaseException | None = None
    for check in checks:
        try:
            check()
            return
        except LiferaftError as e:
            first = first or e
    if first is not None:
        raise first


#: A commit marker is a tiny JSON document: a larger ``COMMIT`` (a sparse file) is refused before it is read.
MARKER_LIMIT = MAX_MARKER_BYTES
#: No manifest is larger than this: a marker saying more is refused.
MANIFEST_LIMIT = MAX_MANIFEST_BYTES


def read_marker(storage: Storage) -> bytes:
    """The bytes of ``COMMIT`` (at most ``MARKER_LIMIT``: a larger one is refused before it is read)."""
    return storage.read_all(COMMIT_MARKER, MARKER_LIMIT)


def read_manifest(storage: Storage, marker: CommitMarker) -> bytes:
    """The bytes of the manifest ``marker`` names, its size compared to the marker's before any of it is read."""
    if not 0 <= marker.manifest_size <= MANIFEST_LIMIT:
        raise CorruptCheckpointError(f"{storage.url}: the commit marker gives manifest {marker.manifest!r} a size of "
                                     f"{marker.manifest_size} bytes (at most {MANIFEST_LIMIT}); it is damaged")
    try:
        return storage.read_all(marker.manifest, marker.manifest_size)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{storage.url}: manifest {marker.manifest!r} is larger than the "
                                     f"{marker.manifest_size} bytes its commit marker records ({e}); the "
                                     "checkpoint is damaged") from e


def read_commit(storage: Storage) -> CommitRecord:
    """The commit record of the checkpoint in ``storage`` (its marker and the manifest it names), as stored
    (both read with their size caps); :func:`open_checkpoint` is what checks them."""
    marker = read_marker(storage)
    decoded = decode_commit_marker(marker)
    return CommitRecord(marker, decoded.manifest, read_manifest(storage, decoded))


#: The manifest ``open_checkpoint(..., reuse=True)`` decoded last: (storage URL, codec names, the manifest's
#: bytes, the manifest). A one-process command that opens one checkpoint several times (``liferaft inspect`` then
#: ``read``, ``diff``'s progress bar then the diff) decodes it once: every open still reads ``COMMIT`` and the
#: manifest (capped, no link followed), compares every byte with these, and checks the references. One entry;
#: ``forget_opened()`` (``liferaft.release()``) drops it.
_OPENED: list[tuple[str, tuple[str, ...], bytes, Manifest]] = []


#: The indexes (version 4+ manifests whose chunk tables were not read) this process committed or opened with
#: ``tables=False`` last, by (storage URL, the hash and size of the manifest's bytes as the commit marker pins them,
#: the codecs registered): an incremental save opens its base, and the siblings the base references, at every save
#: of a manager, and the index of a job of 100,000 ranks takes a second to decode. An open still reads ``COMMIT``
#: and the manifest and checks them against each other; finding their hash here, it returns what those bytes
#: decode to without decoding them again.
INDEXES: PlanCache[tuple[str, str, int, tuple[str, ...]], Manifest] = PlanCache(limit=4)


def forget_opened() -> None:
    """Drop the manifest ``open_checkpoint`` keeps for reuse and the indexes kept (the next open decodes again)."""
    _OPENED.clear()
    INDEXES.clear()


def open_checkpoint(storage: Storage, *, reuse: bool = False, tables: bool = True) -> Manifest:
    """The verified manifest of the committed checkpoint in ``storage``.

    ``reuse``: when the manifest is byte for byte the one the last ``reuse=True`` call decoded (same storage URL,
    same codecs registered), return that decoded manifest instead of decoding it again, and keep this one for the
    next call (one manifest is kept, until ``forget_opened``). Every check below is made as without it: decoding
    and validating is a function of those bytes and codecs alone.

    ``COMMIT`` is read with a small cap and the manifest's size compared to the marker's before it is read (the
    storage opens regular files only, no link: a FIFO, a device, a link to anything is refused). Every reference
    ``../<sibling>/<file>`` must name a data file that the committed manifest of the sibling checkpoint
    ``<sibling>`` (under the same root) lists as its own: nothing else next to the checkpoint is ever read.

    ``tables=False``: a version 4 checkpoint's index only, none of its chunk tables read (a listing of steps:
    the tables are checked when a load or ``verify`` reads them; docs/FORMAT.md §4.6).

    Raises CheckpointNotFoundError (nothing there), IncompleteCheckpointError (files but no commit marker),
    CorruptCheckpointError (manifest missing/damaged/not matching the marker, chunks not tiling a tensor),
    FormatVersionError (written by a newer format) or UnsafePathError (a path leaving the checkpoint, a link, a
    reference to anything but a committed sibling's data file).
    """
    manifest = _open(storage, reuse, tables)
    check_references(storage, manifest)
    return manifest


def _open(storage: Storage, reuse: bool = False, tables: bool = True) -> Manifest:
    """``open_checkpoint`` without the check of references."""
    data, name = read_verified(storage)
    key = (storage.url, digest(data), len(data), codec_registry.names())
    if not tables and (found := INDEXES.get(key)) is not None:
        return replace(found, extra=copy.deepcopy(found.extra))     # (a caller's edit stays its own)
    manifest = decode_verified(storage, data, name, reuse, tables)
    if not tables and manifest.tabled:
        INDEXES.put(key, manifest)
    return manifest


def read_verified(storage: Storage) -> tuple[bytes, str]:
    """The committed manifest's bytes, as its commit marker records them (size and checksum compared), and its
    name: what ``decode_verified`` takes. Raises as ``open_checkpoint`` does for the marker and the manifest's
    bytes."""
    try:
        marker_bytes = read_marker(storage)
    except (FileNotFoundError, NotADirectoryError):
        if storage.has_files():
            raise IncompleteCheckpointError(
                f"{storage.url}: holds files but no {COMMIT_MARKER} marker, so it is not a checkpoint "
                "(a save did not finish). Load an older checkpoint, or save again") from None
        raise CheckpointNotFoundError(f"{storage.url}: no checkpoint there (no {COMMIT_MARKER} marker)") from None
    marker = decode_commit_marker(marker_bytes)
    try:
        data = read_manifest(storage, marker)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url}: the commit marker names manifest {marker.manifest!r}, "
                                     "which is missing") from None
    if len(data) != marker.manifest_size or digest(data) != marker.manifest_hash:
        raise CorruptCheckpointError(f"{storage.url}: manifest {marker.manifest!r} does not match the size/checksum "
                                     "recorded in the commit marker; the checkpoint is damaged")
    return data, marker.manifest


def decode_verified(storage: Storage, data: bytes, name: str, reuse: bool = False, tables: bool = True) -> Manifest:
    """The manifest ``name`` of ``storage`` from its bytes ``data`` (``read_verified``'s), decoded and checked
    (every tensor's chunks tile it; an encoded chunk's frames can hold its blocks): a function of those bytes and
    the codecs registered alone, so ranks given the same bytes decode the same manifest or raise the same error.
    ``reuse`` as in ``open_checkpoint``. ``tables=False``: a version 4 manifest comes back as its index, its
    sharded tensors without chunks and nothing of its chunk tables read (``core.tabled.TableSource`` reads them);
    the chunks it lists (the tensors held whole) are checked as above."""
    if not isinstance(data, bytes) or not isinstance(name, str):
        raise CorruptCheckpointError(f"{storage.url}: the manifest was passed as {type(data).__name__} named "
                                     f"{type(name).__name__}, not bytes and a name")
    codecs = codec_registry.names()
    if reuse and tables:
        for url, names, raw, manifest in _OPENED:
            if url == storage.url and names == codecs and raw == data:
                return manifest
    with paused_gc():
        manifest = decode_manifest(data, f"{storage.url}/{name}", codecs=codecs)
        for entry in manifest.tensors:     # (explicit boxes: the chunk tables list exactly these, by rank)
            problem = entry.boxes is not None and check_chunks_tile(entry.shape, [(o, z) for _, o, z in entry.boxes])
            if problem:
                raise CorruptCheckpointError(f"{storage.url}: tensor {entry.key!r}: its boxes: {problem}; the "
                                             "checkpoint is damaged")
        lazy = manifest.tabled and not tables
        if manifest.tabled and tables:
            manifest = read_tables(storage, manifest, codecs)
        for entry in manifest.tensors:
            if lazy and not entry.held_whole:
                continue                    # (its chunks are checked as the tables holding them are read)
            problem = check_chunks_tile(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
            for c in entry.chunks if problem is None else ():
                if c.codec is not None or c.delta is not None:
                    problem = frames_problem(c) or (c.delta and frames_problem(c.delta))
                    if problem:
                        break
            if problem:
                raise CorruptCheckpointError(f"{storage.url}: tensor {entry.key!r}: {problem}; the checkpoint is "
                                             "damaged")
    if reuse and not lazy:
        _OPENED[:] = [(storage.url, codecs, bytes(data), manifest)]
    return manifest


def read_tables(storage: Storage, index: Manifest, codecs: Collection[str] | None) -> Manifest:
    """``index`` (a version 4 manifest, docs/FORMAT.md §4.6) with the chunks of every table filled in, each table
    checked as a load on ranks checks it (``core.tabled.TableSource``: its size and digest against the index's,
    then every chunk one its rank was planned to write, listed once), then every tensor tiled. Raises
    CorruptCheckpointError naming the table (missing, another size or digest, damaged, not the plan)."""
    from liferaft.core.tabled import TableSource  # (it reads each table with ``read_table``, below)

    src = TableSource(storage, index, codecs)
    src.whole()
    return replace(index, tensors=tuple(src.entry(i) for i in range(len(index.tensors))))


def read_table(storage: Storage, index: Manifest, ref: TableRef, codecs: Collection[str] | None,
               keep: Collection[int] | None = None) -> list[tuple[int, ChunkRecord]]:
    """The decoded chunks of table ``ref`` of ``index``: read at most at the size the index lists (no link
    followed), its size and digest compared with the index's before it is decoded
    (``format.tables.decode_table``; ``keep``: only the chunks of these tensors)."""
    size = index.files[ref.file]
    if size > MANIFEST_LIMIT:
        raise CorruptCheckpointError(f"{storage.url}: chunk table {ref.file!r} is listed with {size} bytes "
                                     f"(at most {MANIFEST_LIMIT}); the checkpoint is damaged")
    try:
        data = storage.read_all(ref.file, size)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url}: chunk table {ref.file!r} is missing; the checkpoint is "
                                     "damaged (restore the file, or load an older checkpoint)") from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{storage.url}: chunk table {ref.file!r} cannot be read as the {size} bytes "
                                     f"the manifest records ({e}); the checkpoint is damaged") from e
    if len(data) != size or digest(data) != ref.hash:
        raise CorruptCheckpointError(f"{storage.url}: chunk table {ref.file!r} does not match the size/checksum "
                                     "the manifest records; the checkpoint is damaged")
    try:
        return decode_table(data, ref, index, codecs, keep)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{storage.url}: {e}") from None


def frames_problem(chunk: ChunkRecord) -> str | None:
    """Why the frames of an encoded chunk cannot hold its blocks (each frame at least ``block / max_expansion``
    bytes of its codec), or None: so that a manifest never makes a reader allocate far beyond the stored bytes."""
    if chunk.codec is None or chunk.frames is None:
        return None
    limit = codec_registry.get(chunk.codec, "chunk").max_expansion
    if limit is None:
        return None
    for i, stored in enumerate(chunk.frames):
        block = min(chunk.block_size, chunk.length - i * chunk.block_size)
        if block > stored * limit:
            return (f"frame {i} of {chunk.file!r} ({stored} bytes of {chunk.codec}) cannot hold a block of {block} "
                    f"bytes (at most {limit} x its size)")
    return None


def check_references(storage: Storage, manifest: Manifest) -> None:
    """UnsafePathError unless every ``../<sibling>/<file>`` of ``manifest`` names a data file listed (as its
    own, not a reference, and not one of its chunk tables) by the committed manifest of the sibling checkpoint
    ``<sibling>`` of ``storage``."""
    wanted: dict[str, list[str]] = {}
    for name in manifest.files:
        if name.startswith("../"):
            sibling, _, rest = name[3:].partition("/")
            wanted.setdefault(sibling, []).append(rest)
    for sibling, names in sorted(wanted.items()):
        if same_place(storage, sibling):
            raise UnsafePathError(f"{storage.url}: the manifest references {sibling!r}, which is this checkpoint "
                                  "itself: a checkpoint's own files are named without '../'; it is damaged")
        try:
            opened = _open(storage.sibling(sibling), tables=False)
            theirs = {f: n for f, n in opened.files.items() if f not in {r.file for r in opened.tables}}
        except (LiferaftError, OSError, NotImplementedError) as e:
            raise UnsafePathError(f"{storage.url}: the manifest references files of {sibling!r} next to it, which is "
                                  f"not a committed checkpoint there ({e}); liferaft reads nothing else outside the "
                                  "checkpoint") from e
        for rest in sorted(names):
            if rest not in theirs or not rest.startswith(DATA_DIR + "/"):
                raise UnsafePathError(f"{storage.url}: the manifest references {f'../{sibling}/{rest}'!r}, which is "
                                      f"not a data file of the committed checkpoint {sibling!r} (replaced since "
                                      "this incremental checkpoint was saved? it needs its base unchanged); "
                                      "liferaft reads nothing else outside the checkpoint")


def same_place(storage: Storage, sibling: str) -> bool:
    """Whether the sibling ``sibling`` of ``storage`` is ``storage`` itself (its own name under its parent, or a
    link to it: ``Storage.place``)."""
    try:
        return storage.sibling(sibling).place.rstrip("/") == storage.place.rstrip("/")
    except (LiferaftError, OSError, NotImplementedError, ValueError):
        return False


def check_files(storage: Storage, manifest: Manifest, names: Iterable[str]) -> None:
    """Raise CorruptCheckpointError if any of ``names`` is missing or shorter than the manifest says."""
    for name in sorted(set(names)):
        try:
            size = storage.size(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.url}: data file {name!r} is missing") from None
        if size < manifest.files[name]:
            raise CorruptCheckpointError(f"{storage.url}: data file {name!r} is truncated ({size} bytes, the "
                                         f"manifest says {manifest.files[name]}); the checkpoint is damaged")


def is_committed(storage: Storage, save_id: str) -> bool:
    """Whether the ``COMMIT`` marker in ``storage`` names the manifest of ``save_id``."""
    try:
        return decode_commit_marker(read_marker(storage)).manifest == manifest_name(save_id)
    except (OSError, LiferaftError):
        return False


def abandon(storage: Storage, name: str | None) -> None:
    """Delete ``name`` (a file of a save that failed) if it is there; never raises."""
    if name is not None:
        try:
            storage.delete(name)
        except OSError:
            pass


def remove_stale(storage: Storage, keep: str) -> None:
    """After a commit: remove liferaft files of other saves (the replaced checkpoint, interrupted saves)."""
    for name in storage.list():
        if is_stale(name, keep):
            storage.delete(name)
