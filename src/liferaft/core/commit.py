"""The commit protocol of one native checkpoint, and the only place that knows its file names.

A checkpoint at a storage root is: data files ``data/<save id>/r<rank>.bin`` (written by each rank), one manifest
``manifest-<save id>.json`` (written by rank 0 once every rank's data is durable) and the marker ``COMMIT`` naming
that manifest with its size and checksum, put atomically last: the checkpoint exists from that moment and never
before. After a commit, files of other saves (the replaced checkpoint, interrupted saves) are removed. The save
path, the memory tier, the manager and the tools all go through these functions (docs/FORMAT.md §8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from liferaft.codecs import registry as codec_registry
from liferaft.codecs.checksum import digest
from liferaft.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, LiferaftError
from liferaft.format.layout import COMMIT_MARKER, is_stale, manifest_name
from liferaft.format.manifest import ChunkRecord, CommitMarker, Manifest, decode_commit_marker, decode_manifest
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
    the checkpoint exists once this returns (rank 0, after every rank's data is durable)."""
    data = manifest.to_json_bytes()
    name = manifest_name(save_id)
    marker = CommitMarker(manifest=name, manifest_size=len(data), manifest_hash=digest(data),
                          version=manifest.needs_version())
    record = CommitRecord(marker.to_json_bytes(), name, data)
    publish_commit(storage, record)
    return record


def publish_commit(storage: Storage, record: CommitRecord) -> None:
    """Put the manifest, make it durable, then put the marker atomically (every data file must be there)."""
    storage.put_atomic(record.manifest_name, record.manifest)
    storage.sync()
    storage.put_atomic(COMMIT_MARKER, record.marker)


def read_commit(storage: Storage) -> CommitRecord:
    """The commit record of the checkpoint in ``storage`` (its marker and the manifest it names), as stored;
    :func:`open_checkpoint` is what checks them."""
    marker = storage.read_all(COMMIT_MARKER)
    name = decode_commit_marker(marker).manifest
    return CommitRecord(marker, name, storage.read_all(name))


def open_checkpoint(storage: Storage) -> Manifest:
    """The verified manifest of the committed checkpoint in ``storage``.

    Raises CheckpointNotFoundError (nothing there), IncompleteCheckpointError (files but no commit marker),
    CorruptCheckpointError (manifest missing/damaged/not matching the marker, chunks not tiling a tensor),
    FormatVersionError (written by a newer format) or UnsafePathError (a path leaving the checkpoint).
    """
    try:
        marker_bytes = storage.read_all(COMMIT_MARKER)
    except (FileNotFoundError, NotADirectoryError):
        files = storage.list()
        if files:
            raise IncompleteCheckpointError(
                f"{storage.url}: holds {len(files)} file(s) but no {COMMIT_MARKER} marker, so it is not a checkpoint "
                "(a save did not finish). Load an older checkpoint, or save again") from None
        raise CheckpointNotFoundError(f"{storage.url}: no checkpoint there (no {COMMIT_MARKER} marker)") from None
    marker = decode_commit_marker(marker_bytes)
    try:
        data = storage.read_all(marker.manifest)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url}: the commit marker names manifest {marker.manifest!r}, "
                                     "which is missing") from None
    if len(data) != marker.manifest_size or digest(data) != marker.manifest_hash:
        raise CorruptCheckpointError(f"{storage.url}: manifest {marker.manifest!r} does not match the size/checksum "
                                     "recorded in the commit marker; the checkpoint is damaged")
    manifest = decode_manifest(data, f"{storage.url}/{marker.manifest}", codecs=codec_registry.names())
    for entry in manifest.tensors:
        problem = check_chunks_tile(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks]) or next(
            (p for c in entry.chunks for p in (_frames_problem(c), c.delta and _frames_problem(c.delta)) if p), None)
        if problem:
            raise CorruptCheckpointError(f"{storage.url}: tensor {entry.key!r}: {problem}; the checkpoint is damaged")
    return manifest


def _frames_problem(chunk: ChunkRecord) -> str | None:
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
        return decode_commit_marker(storage.read_all(COMMIT_MARKER)).manifest == manifest_name(save_id)
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
