"""The public entry points: save, async_save and load.

save: prepare (flatten, exchange, plan) → write → finish (hashes, manifest, ``COMMIT``), see ``_save``;
async_save: the same with a snapshot into a buffer pool and the rest in the background, see ``_async``;
load: open → plan → read → apply, below. Every step that can fail on one rank is followed by an exchange, so
that every rank raises when any rank fails and nothing hangs (collectives time out).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import torch

from liferaft._async import AsyncSaveHandle, async_save, settle_previous, sync_ring
from liferaft._save import finish_save, prepare_save
from liferaft.dist import Coordinator
from liferaft.errors import LossyCheckpointError, StateMismatchError
from liferaft.format.manifest import Manifest, PathPart
from liferaft.options import LoadOptions, LoadResult, SaveOptions, SaveResult
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.share_plan import MIN_SHARED_BYTES, plan_sharing
from liferaft.reading import PerRank, as_leaf, check_files, decode_entry_value, open_checkpoint
from liferaft.state.flatten import FlatState, flatten
from liferaft.state.matching import drop_absent, matches_emptied, not_persisted, settle_missing
from liferaft.staging.stager import staged_size
from liferaft.storage import Storage, resolve
from liferaft.storage.refs import with_references
from liferaft.transfer.reader import ReadStats, execute_reads
from liferaft.transfer.tensors import torch_dtype
from liferaft.transfer.writer import write_streamed

__all__ = ["AsyncSaveHandle", "async_save", "load", "save"]

PathLike = str | os.PathLike[str]


def save(path: PathLike, state: Any, *, process_group: Any = None, options: SaveOptions | None = None) -> SaveResult:
    """Save ``state`` to ``path``, collectively over ``process_group`` (default: the world, or one process).

    ``state`` is any nesting of dict/list/tuple holding tensors (replicated), DTensors, :class:`Sharded`
    shards, objects with ``state_dict()``/``load_state_dict()`` and plain values. The checkpoint exists only
    once every rank's data is durable and the commit marker is written; on any failure every rank raises and
    a checkpoint previously at ``path`` is untouched. Waits for (or skips / refuses, per
    ``SaveOptions.if_busy``) an ``async_save`` of this process still in flight.

    The bytes stream through a small ring of host memory (64 MiB, or ``memory_budget`` if smaller; the
    ``async_save`` pool when the process has one), kept for later saves: a copy into it overlaps the direct
    (O_DIRECT) write of the previous piece, so no page cache is filled and extra memory stays bounded.
    """
    opts = options or SaveOptions()
    if not settle_previous(opts, process_group):
        return None  # type: ignore[return-value]  # if_busy="skip"
    coord = Coordinator(process_group, opts.timeout)
    prep = prepare_save(state, coord, resolve(path), opts)
    outcome, err, pool = None, None, None
    try:
        pin = torch.cuda.is_available() and any(t.is_cuda for t in prep.sources.values())
        nbytes = staged_size(prep.writes, prep.sources, 1 << 20)     # (with the padding of the smallest pieces)
        pool = sync_ring(nbytes, opts.memory_budget, pin)
        outcome = write_streamed(prep.storage, prep.writes, prep.sources, pool, prep.policy)
        prep.storage.sync()   # this rank's new folder entries are durable too, not only its file
    except BaseException as e:  # noqa: BLE001 - reported to every rank
        err = e
    result = finish_save(coord, prep, outcome, err, opts)
    return dataclasses.replace(result, staging_bytes=pool.capacity if pool is not None else 0)


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
    ``path`` may also be a Hugging Face safetensors folder (or file): then each rank memory-maps it and copies
    the boxes it holds (``tools.sources``; safetensors have no checksums, so these bytes are not verified); or a
    PyTorch DCP checkpoint folder (``tools.dcp_format``: each rank memory-maps the data files and copies the
    parts of the saved chunks its boxes overlap; DCP has no checksums either).
    """
    opts = options or LoadOptions()
    from liferaft.tools.dcp_format import is_dcp as is_dcp_source
    from liferaft.tools.sources import is_safetensors_source, load_dcp, load_safetensors

    if is_safetensors_source(path):         # a Hugging Face model: each rank reads the boxes it holds (unverified)
        return load_safetensors(path, state, strict, process_group)
    if is_dcp_source(path):                 # a PyTorch DCP checkpoint: the same, from the chunks' blobs
        return load_dcp(path, state, strict, process_group)
    t_start = time.perf_counter()
    coord = Coordinator(process_group, opts.timeout)
    storage = with_references(resolve(path))
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
        plan = _plan_load(storage, manifest, flatten(state, template=True), coord, opts)
    except BaseException as e:  # noqa: BLE001
        err = e
    share = opts.share_reads if opts.share_reads is not None else storage.remote
    spans = [] if plan is None or not share else \
        [(u.file, u.file_offset, u.length) for u, _ in plan.units if u.length >= MIN_SHARED_BYTES]
    gathered = coord.exchange((plan.covered, plan.missing, spans, plan.skipped) if plan else None, err,
                              "load (planning)")
    assert plan is not None
    all_keys = [t.key for t in manifest.tensors] + [v.key for v in manifest.values]
    covered = bytearray(len(all_keys))
    for c, *_ in gathered:
        covered = bytearray(a | b for a, b in zip(covered, c))
    unexpected = tuple(k for k, hit in zip(all_keys, covered) if not hit)
    missing = tuple(sorted({k for _, m, *_ in gathered for k in m}))
    skipped = tuple(sorted({k for *_, s in gathered for k in s}))
    sharing = plan_sharing([g[2] for g in gathered]) if coord.world > 1 else {}
    peers = coord if sharing else None
    if strict and (missing or unexpected):
        raise StateMismatchError(_mismatch_message(storage.url, missing, unexpected))
    timings["plan"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    stats = ReadStats()
    if opts.atomic:
        try:
            execute_reads(storage, plan.units, plan.targets, copy=False, max_read=opts.max_read_bytes,
                          peers=peers, rank=coord.rank, sharing=sharing)
        except BaseException as e:  # noqa: BLE001
            err = e
        coord.exchange(None, err, "load (verify)")
        timings["verify"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    try:
        stats = execute_reads(storage, plan.units, plan.targets, max_read=opts.max_read_bytes,
                              peers=peers, rank=coord.rank, sharing=sharing)
    except BaseException as e:  # noqa: BLE001
        err = e
    coord.exchange(None, err, "load (read)")
    timings["read"] = time.perf_counter() - t0
    timings["checksum"] = stats.verify_s        # part of "read" (overlapped with the I/O): the cost of verifying

    t0 = time.perf_counter()
    try:
        plan.apply()
    except BaseException as e:  # noqa: BLE001
        err = e
    coord.exchange(None, err, "load (apply)")
    timings["apply"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    if plan.lossy:
        shown = "; ".join(f"{k}: {_describe_lossy(v)}" for k, v in list(plan.lossy.items())[:5])
        more = f" and {len(plan.lossy) - 5} more" if len(plan.lossy) > 5 else ""
        warnings.warn(f"{storage.url}: {len(plan.lossy)} loaded tensor(s) were stored lossily: {shown}{more}",
                      stacklevel=2)
    return LoadResult(path=storage.url, rank=coord.rank, bytes_read=stats.used, bytes_received=stats.received,
                      missing_keys=missing, unexpected_keys=unexpected, timings=timings, lossy=plan.lossy,
                      skipped_keys=skipped)


def _describe_lossy(how: Any) -> str:
    if how.get("method") == "q8-block":
        return (f"8-bit block quantization, max abs error {how.get('max_abs_error', float('nan')):.3g}, mean "
                f"{how.get('mean_abs_error', float('nan')):.3g}")
    if how.get("method") == "selective":
        return (f"{how.get('chunks')} of {how.get('of_chunks')} chunk(s) not saved at this step but taken from "
                f"{', '.join(how.get('from') or [])} (relative change up to {how.get('max_change', 0):.3g})")
    return str(how)


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
        self.absent: list[tuple[PathPart, ...]] = []   # optional subtrees the checkpoint lacks (state.matching)
        self.skipped: list[str] = []                   # checkpoint keys the state does not persist
        self.lossy: dict[str, dict[str, Any]] = {}

    def apply(self) -> None:
        for path, entry, idx in self.fresh:
            self.assign.append((path, as_leaf(entry, self.targets[idx])))
        for path, value in self.assign:
            _assign(self.flat, path, value)
        drop_absent(self.flat, self.absent)
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
            if entry.lossy is not None:
                if opts.exact:
                    raise LossyCheckpointError(
                        f"key {leaf.key!r} is stored lossily in the checkpoint ({_describe_lossy(entry.lossy)}) and "
                        "the load asked for an exact resume (LoadOptions(exact=True)); nothing was loaded. Load an "
                        "exact checkpoint, or load without exact=True to accept the recorded error")
                plan.lossy[leaf.key] = dict(entry.lossy)
            want(entry, leaf.parts)
        else:
            _plan_value(plan, leaf.key, leaf.path, tensors, values, index, want, coord, opts)
    for key, path, _ in flat.values:
        _plan_value(plan, key, path, tensors, values, index, want, coord, opts)
    plan.missing, plan.absent = settle_missing(flat, plan.missing)
    for v in manifest.values if plan.absent else ():
        if not plan.covered[index[v.key]] and v.path in flat.nodes and v.per_rank is None and \
                matches_emptied(flat, plan.absent, v.path, decode_entry_value(v, opts.allow_pickle)):
            plan.covered[index[v.key]] = 1
    plan.skipped = not_persisted(flat, (k for k, i in index.items() if not plan.covered[i]))
    for k in plan.skipped:
        plan.covered[index[k]] = 1
    check_files(storage, manifest, files)
    return plan


def _plan_value(plan: _LoadPlan, key: str, path: tuple, tensors: dict, values: dict, index: dict, want: Any,
                coord: Coordinator, opts: LoadOptions) -> None:
    v = values.get(key)
    if v is not None:
        value = decode_entry_value(v, opts.allow_pickle)
        if isinstance(value, PerRank):
            if len(value) != coord.world and _accepts_per_rank(plan.flat, path):
                plan.assign.append((path, value))       # the object maps the saved ranks' values itself
                plan.covered[index[key]] = 1
                return
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


def _accepts_per_rank(flat: FlatState, path: tuple) -> bool:
    """Whether ``path`` lies under a stateful object that takes per-rank values of another world size itself
    (``accepts_per_rank = True``, e.g. ``RNGState``)."""
    for spath, adapter, _ in flat.statefuls:
        if path[:len(spath)] == spath and getattr(getattr(adapter, "obj", None), "accepts_per_rank", False):
            return True
    return False


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
