"""save and load: plan → stage → write → commit, and open → plan → read → apply, as readable sequences.

Every step that can fail on one rank is followed by an exchange, so that every rank raises when any rank
fails and nothing hangs (collectives time out). Commit protocol (docs/FORMAT.md): every rank writes and
fsyncs its data file; after all ranks reported success, rank 0 writes the manifest, then atomically
replaces the ``COMMIT`` marker that names it, then removes the files of the checkpoint it replaced.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings
from typing import Any

import torch

from liferaft.dist import Coordinator
from liferaft.errors import CheckpointExistsError, LiferaftError, StateMismatchError, StorageError
from liferaft.format.manifest import COMMIT_MARKER, CommitMarker, Manifest, PathPart, decode_commit_marker
from liferaft.codecs.checksum import digest
from liferaft.options import LoadOptions, LoadResult, SaveOptions, SaveResult
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.save_plan import RankMeta, TensorMeta, ValueMeta, build_manifest, plan_save
from liferaft.reading import as_leaf, check_files, decode_entry_value, open_checkpoint, PerRank
from liferaft.state.flatten import FlatState, flatten
from liferaft.state.values import digest_encoded, encode_value
from liferaft.storage import Storage, resolve
from liferaft.transfer.reader import execute_reads
from liferaft.transfer.tensors import torch_dtype
from liferaft.transfer.writer import write_items

PathLike = str | os.PathLike[str]


def _version() -> str:
    from liferaft import __version__

    return __version__


def _rank_meta(rank: int, flat: FlatState, allow_pickle: bool) -> RankMeta:
    tensors = tuple(TensorMeta(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype_name, shape=t.shape,
                               boxes=tuple(b for b, _ in t.parts)) for t in flat.tensors)
    values = []
    for key, path, v in flat.values:
        enc = encode_value(v, key, allow_pickle)
        values.append(ValueMeta(key=key, path=path, encoded=enc, digest=digest_encoded(enc)))
    return RankMeta(rank=rank, tensors=tensors, values=tuple(values), containers=tuple(flat.containers))


def save(path: PathLike, state: Any, *, process_group: Any = None, options: SaveOptions | None = None) -> SaveResult:
    """Save ``state`` to ``path``, collectively over ``process_group`` (default: the world, or one process).

    ``state`` is any nesting of dict/list/tuple holding tensors (replicated), DTensors, :class:`Sharded`
    shards, objects with ``state_dict()``/``load_state_dict()`` and plain values. The checkpoint exists only
    once every rank's data is durable and the commit marker is written; on any failure every rank raises and
    a checkpoint previously at ``path`` is untouched.
    """
    opts = options or SaveOptions()
    t_start = time.perf_counter()
    coord = Coordinator(process_group, opts.timeout)
    storage = resolve(path)
    timings: dict[str, float] = {}
    flat = meta = None
    payload: tuple[RankMeta | None, str | None] = (None, None)
    err: BaseException | None = None
    try:
        if sys.byteorder != "little":
            raise StorageError("liferaft stores little-endian bytes; big-endian hosts are not supported")
        if storage.process_local and coord.world > 1:
            raise StorageError(f"{storage.url} is process-local; a save from {coord.world} ranks needs a shared "
                               "backend (a local path, file:// or an object store)")
        flat = flatten(state)
        meta = _rank_meta(coord.rank, flat, opts.allow_pickle)
        if coord.rank == 0 and not opts.overwrite and storage.exists(COMMIT_MARKER):
            raise CheckpointExistsError(f"{storage.url} already holds a committed checkpoint; pass "
                                        "SaveOptions(overwrite=True) to replace it, or save to a new path")
        payload = (meta, uuid.uuid4().hex[:16] if coord.rank == 0 else None)
    except BaseException as e:  # noqa: BLE001 - reported to every rank
        err = e
    gathered = coord.exchange(payload, err, "save (planning)")
    save_id = gathered[0][1]
    plan = plan_save([g[0] for g in gathered], save_id, opts.alignment)
    timings["plan"] = time.perf_counter() - t_start

    outcome = None
    my_file = plan.writes[coord.rank][0].file if plan.writes[coord.rank] else None
    try:
        assert flat is not None
        sources = {(t.key, box): local for t in flat.tensors for box, local in t.parts}
        outcome = write_items(storage, plan.writes[coord.rank], sources, opts.block_size)
        storage.sync()   # this rank's new folder entries are durable too, not only its file
    except BaseException as e:  # noqa: BLE001
        err = e
    try:
        hashes = coord.exchange(outcome.hashes if outcome else None, err, "save (write)")
    except BaseException:
        _abandon(storage, my_file)
        raise
    timings["stage"] = outcome.stage_s if outcome else 0.0
    timings["write"] = outcome.write_s if outcome else 0.0

    t0 = time.perf_counter()
    try:
        if coord.rank == 0:
            manifest = build_manifest(plan, hashes, save_id=save_id,
                                      created_unix=time.time(), liferaft_version=_version(),
                                      torch_version=torch.__version__, extra=opts.metadata)
            data = manifest.to_json_bytes()
            name = f"manifest-{save_id}.json"
            storage.put_atomic(name, data)
            storage.sync()
            marker = CommitMarker(manifest=name, manifest_size=len(data), manifest_hash=digest(data))
            storage.put_atomic(COMMIT_MARKER, marker.to_json_bytes())
    except OSError as e:
        err = StorageError(f"{storage.url}: writing the manifest or the commit marker failed: {e}")
    except BaseException as e:  # noqa: BLE001
        err = e
    try:
        coord.exchange(None, err, "save (commit)")
    except BaseException:
        # A peer may have died after rank 0 committed: never delete files a committed checkpoint needs.
        if not _is_committed(storage, save_id):
            _abandon(storage, my_file)
        raise
    if coord.rank == 0:
        try:
            _remove_stale(storage, keep=save_id)
        except OSError as e:
            warnings.warn(f"{storage.url}: checkpoint committed, but removing files of the checkpoint it replaced "
                          f"failed ({e}); they are unused and can be deleted", stacklevel=2)
    timings["commit"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    return SaveResult(path=storage.url, save_id=save_id, world_size=coord.world, rank=coord.rank,
                      bytes_written=outcome.bytes_written if outcome else 0, total_bytes=sum(plan.files.values()),
                      files=len(plan.files), timings=timings)


def _is_committed(storage: Storage, save_id: str) -> bool:
    try:
        return decode_commit_marker(storage.read_all(COMMIT_MARKER)).manifest == f"manifest-{save_id}.json"
    except (OSError, LiferaftError):
        return False


def _abandon(storage: Storage, name: str | None) -> None:
    if name is not None:
        try:
            storage.delete(name)
        except OSError:
            pass


def _remove_stale(storage: Storage, keep: str) -> None:
    """After a commit: remove liferaft files of other saves (the replaced checkpoint, interrupted saves)."""
    for name in storage.list():
        stale_data = name.startswith("data/") and not name.startswith(f"data/{keep}/")
        stale_manifest = name.startswith("manifest-") and name != f"manifest-{keep}.json"
        stale_temp = ".tmp-" in name.rsplit("/", 1)[-1] and not name.startswith("data/")
        if stale_data or stale_manifest or stale_temp:
            storage.delete(name)


def load(path: PathLike, state: Any, *, process_group: Any = None, strict: bool = True,
         options: LoadOptions | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place, in the layout ``state`` has now.

    Tensors, DTensors and ``Sharded`` shards are filled in place from whichever saved chunks overlap them
    (only those byte ranges are read, every byte verified); plain values are replaced in their containers;
    stateful objects get ``load_state_dict`` with the loaded values. With ``strict`` (default) a key missing
    from the checkpoint or present in it but absent from every rank's state raises StateMismatchError before
    anything is changed; otherwise they are listed in the result. Shape/dtype mismatches always raise. Every
    check that needs no data (keys, shapes, dtypes, files present and long enough, format version, paths) runs
    on every rank before any byte is copied; ``LoadOptions(atomic=True)`` extends that to the checksums.
    """
    opts = options or LoadOptions()
    t_start = time.perf_counter()
    coord = Coordinator(process_group, opts.timeout)
    storage = resolve(path)
    timings: dict[str, float] = {}
    manifest = None
    err: BaseException | None = None
    if coord.rank == 0:
        try:
            manifest = open_checkpoint(storage)
        except BaseException as e:  # noqa: BLE001
            err = e
    manifest = coord.broadcast_from_zero(manifest, err, "load (open)")
    assert manifest is not None

    plan: _LoadPlan | None = None
    try:
        plan = _plan_load(storage, manifest, flatten(state), coord, opts)
    except BaseException as e:  # noqa: BLE001
        err = e
    gathered = coord.exchange((plan.covered, plan.missing) if plan else None, err, "load (planning)")
    assert plan is not None
    all_keys = [t.key for t in manifest.tensors] + [v.key for v in manifest.values]
    covered = bytearray(len(all_keys))
    for c, _ in gathered:
        covered = bytearray(a | b for a, b in zip(covered, c))
    unexpected = tuple(k for k, hit in zip(all_keys, covered) if not hit)
    missing = tuple(sorted({k for _, m in gathered for k in m}))
    if strict and (missing or unexpected):
        raise StateMismatchError(_mismatch_message(storage.url, missing, unexpected))
    timings["plan"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    nbytes = 0
    if opts.atomic:
        try:
            execute_reads(storage, plan.units, plan.targets, copy=False)
        except BaseException as e:  # noqa: BLE001
            err = e
        coord.exchange(None, err, "load (verify)")
        timings["verify"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    try:
        nbytes = execute_reads(storage, plan.units, plan.targets)
    except BaseException as e:  # noqa: BLE001
        err = e
    coord.exchange(None, err, "load (read)")
    timings["read"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        plan.apply()
    except BaseException as e:  # noqa: BLE001
        err = e
    coord.exchange(None, err, "load (apply)")
    timings["apply"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    return LoadResult(path=storage.url, rank=coord.rank, bytes_read=nbytes, missing_keys=missing,
                      unexpected_keys=unexpected, timings=timings)


def _mismatch_message(url: str, missing: tuple[str, ...], unexpected: tuple[str, ...]) -> str:
    parts = [f"{url}: the state does not match the checkpoint (nothing was loaded)."]
    if missing:
        parts.append(f"Missing from the checkpoint: {', '.join(repr(k) for k in missing[:10])}"
                     + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
    if unexpected:
        parts.append(f"In the checkpoint but not in the state: {', '.join(repr(k) for k in unexpected[:10])}"
                     + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    parts.append("Pass strict=False to load the keys that match and list the others in the result.")
    return " ".join(parts)


class _LoadPlan:
    """One rank's load: reads into targets, then values to assign and stateful objects to update."""

    def __init__(self, flat: FlatState) -> None:
        self.flat = flat
        self.units: list = []
        self.targets: list[torch.Tensor] = []
        self.assign: list[tuple[tuple[PathPart, ...], Any]] = []
        self.fresh: list[tuple[tuple[PathPart, ...], Any, int]] = []   # (path, entry, target index)
        self.covered = bytearray()     # one byte per manifest key (tensors, then values): 1 = this rank loads it
        self.missing: list[str] = []

    def apply(self) -> None:
        for path, entry, idx in self.fresh:
            self.assign.append((path, as_leaf(entry, self.targets[idx])))
        for path, value in self.assign:
            _assign(self.flat, path, value)
        for _, adapter, sd in reversed(self.flat.statefuls):
            adapter.load_state_dict(sd)


def _plan_load(storage: Storage, manifest: Manifest, flat: FlatState, coord: Coordinator,
               opts: LoadOptions) -> _LoadPlan:
    plan = _LoadPlan(flat)
    tensors = manifest.tensor_map()
    values = {v.key: v for v in manifest.values}
    index = {k: i for i, k in enumerate([t.key for t in manifest.tensors] + [v.key for v in manifest.values])}
    plan.covered = bytearray(len(index))
    files: set[str] = set()

    def want(entry: Any, boxes: list[tuple[tuple, torch.Tensor]]) -> None:
        for box, local in boxes:
            plan.targets.append(local)
            units = plan_reads(entry, [(len(plan.targets) - 1, box)], opts.max_read_bytes)
            plan.units.extend((u, local.dtype) for u in units)
            files.update(u.file for u in units)

    for leaf in flat.tensors:
        entry = tensors.get(leaf.key)
        if leaf.kind == "tensor":
            if entry is None:
                if leaf.key in values:
                    raise StateMismatchError(f"key {leaf.key!r} is a plain value in the checkpoint but a tensor in "
                                             "the state")
                plan.missing.append(leaf.key)
                continue
            if entry.kind != "tensor" or entry.dtype != leaf.dtype_name or entry.shape != leaf.shape:
                raise StateMismatchError(
                    f"key {leaf.key!r}: the checkpoint holds {entry.kind} {list(entry.shape)} {entry.dtype} but "
                    f"the state holds {list(leaf.shape)} {leaf.dtype_name}; nothing was loaded")
            plan.covered[index[leaf.key]] = 1
            want(entry, leaf.parts)
        else:
            _plan_value(plan, leaf.key, leaf.path, tensors, values, index, want, coord, opts)
    for key, path, _ in flat.values:
        _plan_value(plan, key, path, tensors, values, index, want, coord, opts)
    check_files(storage, manifest, files)
    return plan


def _plan_value(plan: _LoadPlan, key: str, path: tuple, tensors: dict, values: dict, index: dict, want: Any,
                coord: Coordinator, opts: LoadOptions) -> None:
    v = values.get(key)
    if v is not None:
        value = decode_entry_value(v, opts.allow_pickle)
        if isinstance(value, PerRank):
            if len(value) != coord.world:
                raise StateMismatchError(
                    f"key {key!r} held a different value on each of the {len(value)} saving ranks; it cannot be "
                    f"mapped onto {coord.world} ranks. Make it equal on all ranks, or load with the same world size")
            value = value[coord.rank]
        plan.assign.append((path, value))
    elif key in tensors and tensors[key].kind in ("numpy", "bytes"):
        entry = tensors[key]
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        want(entry, [((tuple(0 for _ in entry.shape), entry.shape), target)])
        plan.fresh.append((path, entry, len(plan.targets) - 1))
    elif key in tensors:
        raise StateMismatchError(f"key {key!r} is a tensor in the checkpoint but a plain value in the state; "
                                 f"put a tensor of shape {list(tensors[key].shape)} there")
    else:
        plan.missing.append(key)
        return
    plan.covered[index[key]] = 1


def _assign(flat: FlatState, path: tuple[PathPart, ...], value: Any) -> None:
    parent_path, k = path[:-1], path[-1]
    parent = flat.nodes[parent_path]
    if isinstance(parent, tuple):
        new = list(parent)
        new[k] = value
        rebuilt = tuple(new)
        flat.nodes[parent_path] = rebuilt
        if parent_path:
            _assign(flat, parent_path, rebuilt)
        return
    parent[k] = value
