"""The native load: open → plan → read → apply. Every step that can fail on one rank is followed by an exchange,
so that every rank raises when any rank fails and nothing hangs (collectives time out)."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from liferaft.core.chunks.dtypes import torch_dtype
from liferaft.core.chunks.reader import ReadStats, execute_reads
from liferaft.core.commit import check_files, open_checkpoint
from liferaft.core.read import PerRank, as_leaf, copy_shape, decode_entry_value, per_rank_leaf
from liferaft.dist import Coordinator
from liferaft.errors import CheckpointNotFoundError, LossyCheckpointError, StateMismatchError
from liferaft.format.manifest import Manifest, PathPart
from liferaft.options import LoadOptions, LoadResult
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.share_plan import MIN_SHARED_BYTES, plan_sharing
from liferaft.state.flatten import FlatState, flatten, key_of
from liferaft.state.matching import drop_absent, matches_emptied, not_persisted, param_groups_mismatch, settle_missing
from liferaft.storage import Storage, resolve
from liferaft.storage.refs import with_references

__all__ = ["load"]

PathLike = str | os.PathLike[str]


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
    from liferaft.formats.dcp import is_dcp as is_dcp_source
    from liferaft.tools.sources import is_safetensors_source, load_dcp, load_safetensors

    if is_safetensors_source(path):         # a Hugging Face model: each rank reads the boxes it holds (unverified)
        return load_safetensors(path, state, strict, process_group)
    if is_dcp_source(path):                 # a PyTorch DCP checkpoint: the same, from the chunks' blobs
        return load_dcp(path, state, strict, process_group)
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{os.fspath(path)} is a file, not a checkpoint folder: liferaft.load reads liferaft, DCP and "
            "safetensors checkpoints. A torch.save file is a pickle and is not loaded as it is; convert it first "
            "(`liferaft convert FILE DST --to liferaft`, which reads it with weights_only=True)")
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
        plan = _plan_load(storage, manifest, flatten(state, template=True, world=coord.world), coord, opts, strict)
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
        self.fresh: list[tuple[tuple[PathPart, ...], Any, torch.Tensor]] = []   # (path, entry, tensor read into)
        #: per-rank entries loaded whole on another world size: (path, entry, target index, saving world size)
        self.fresh_per_rank: list[tuple[tuple[PathPart, ...], Any, torch.Tensor, int]] = []
        self.covered = bytearray()     # one byte per manifest key (tensors, then values): 1 = this rank loads it
        self.missing: list[str] = []
        self.strict = True             # False: a per-rank key that cannot be mapped is listed as missing
        self.absent: list[tuple[PathPart, ...]] = []   # optional subtrees the checkpoint lacks (state.matching)
        self.skipped: list[str] = []                   # checkpoint keys the state does not persist
        self.lossy: dict[str, dict[str, Any]] = {}

    def apply(self) -> None:
        for path, entry, target in self.fresh:
            self.assign.append((path, as_leaf(entry, target)))
        for path, entry, target, world in self.fresh_per_rank:
            self.assign.append((path, per_rank_leaf(entry, target, world)))
        for path, value in self.assign:
            _assign(self.flat, path, value)
        drop_absent(self.flat, self.absent)
        for _, adapter, sd in reversed(self.flat.statefuls):
            adapter.load_state_dict(sd)


def _plan_load(storage: Storage, manifest: Manifest, flat: FlatState, coord: Coordinator,
               opts: LoadOptions, strict: bool = True) -> _LoadPlan:
    plan = _LoadPlan(flat)
    plan.strict = strict
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
            if entry.kind != "tensor" or entry.dtype != leaf.dtype_name or copy_shape(entry) != leaf.shape:
                raise StateMismatchError(
                    f"key {leaf.key!r}: the checkpoint holds {entry.kind} {list(copy_shape(entry))} {entry.dtype}"
                    f"{' per rank' if entry.per_rank is not None else ''} but the state holds {list(leaf.shape)} "
                    f"{leaf.dtype_name}; nothing was loaded")
            plan.covered[index[leaf.key]] = 1
            if entry.lossy is not None:
                if opts.exact:
                    raise LossyCheckpointError(
                        f"key {leaf.key!r} is stored lossily in the checkpoint ({_describe_lossy(entry.lossy)}) and "
                        "the load asked for an exact resume (LoadOptions(exact=True)); nothing was loaded. Load an "
                        "exact checkpoint, or load without exact=True to accept the recorded error")
                plan.lossy[leaf.key] = dict(entry.lossy)
            if entry.per_rank is None:
                want(entry, leaf.parts)
                continue
            full = (tuple(0 for _ in leaf.shape), leaf.shape)
            if any(box != full for box, _ in leaf.parts):
                raise StateMismatchError(f"key {leaf.key!r} was saved per rank (its copies differed between the "
                                         "ranks), but the state holds a shard of it; nothing was loaded")
            row = _per_rank_row(plan, leaf.key, leaf.path, entry, manifest.world_size, coord)
            if row is None:
                continue
            if row >= 0:
                want(entry, [(((row,) + full[0], (1,) + full[1]), local.unsqueeze(0)) for _, local in leaf.parts])
            else:
                _want_all_rows(plan, leaf.path, entry, manifest.world_size, want)
        else:
            _plan_value(plan, leaf.key, leaf.path, tensors, values, index, want, coord, opts)
    for key, path, _ in flat.values:
        _plan_value(plan, key, path, tensors, values, index, want, coord, opts, manifest.world_size)
    for spath, adapter, _ in flat.statefuls:     # objects that refuse what they would load, before any byte moves
        check = getattr(adapter, "check_load", None)
        if check is not None:
            check({p[len(spath):]: v for p, v in plan.assign if p[:len(spath)] == spath}, coord.world,
                  f"key {key_of(spath)!r}")
    kept = []
    for path, value in plan.assign:             # another kind of optimizer's param_groups (state.matching)
        problem = param_groups_mismatch(flat, path, value)
        if problem is None:
            kept.append((path, value))
            continue
        if strict:
            raise StateMismatchError(f"{problem}; nothing was loaded. Load it into the optimizer that saved it, "
                                     "or pass strict=False to keep the live optimizer's param_groups")
        plan.covered[index[key_of(path)]] = 0
        plan.missing.append(key_of(path))
    plan.assign = kept
    plan.missing, plan.absent = settle_missing(
        flat, plan.missing, {c.path: c.cls for c in manifest.containers if c.kind == "stateful"}, index)
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
                coord: Coordinator, opts: LoadOptions, saved_world: int) -> None:
    v = values.get(key)
    if v is not None:
        value = decode_entry_value(v, opts.allow_pickle)
        if isinstance(value, PerRank):
            if len(value) != coord.world and _accepts_per_rank(plan.flat, path):
                plan.assign.append((path, value))       # the object maps the saved ranks' values itself
                plan.covered[index[key]] = 1
                return
            if len(value) != coord.world:
                raise StateMismatchError(_resize_message(plan.flat, key, path, len(value), coord.world))
            value = value[coord.rank]
        plan.assign.append((path, value))
    elif key in tensors and tensors[key].kind in ("numpy", "bytes"):
        entry = tensors[key]
        if entry.per_rank is None:
            target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
            want(entry, [((tuple(0 for _ in entry.shape), entry.shape), target)])
            plan.fresh.append((path, entry, target))
        else:
            row = _per_rank_row(plan, key, path, entry, saved_world, coord)
            if row is None:
                return
            if row >= 0:
                shape = copy_shape(entry)
                target = torch.empty(shape, dtype=torch_dtype(entry.dtype))
                want(entry, [(((row,) + tuple(0 for _ in shape), (1,) + shape), target.unsqueeze(0))])
                plan.fresh.append((path, entry, target))
            else:
                _want_all_rows(plan, path, entry, saved_world, want)
    elif key in tensors:
        raise StateMismatchError(f"key {key!r} is a tensor in the checkpoint but a plain value in the state; "
                                 f"put a tensor of shape {list(tensors[key].shape)} there")
    else:
        plan.missing.append(key)
        return
    plan.covered[index[key]] = 1


def _per_rank_row(plan: _LoadPlan, key: str, path: tuple, entry: Any, saved_world: int,
                  coord: Coordinator) -> int | None:
    """Which row of a tensor stored per rank this rank loads: its own when the world size is the one that saved
    (None, and the key is missing, if this rank did not hold it then); -1: every row, as a ``PerRank`` for an
    object that maps the saved ranks itself (``accepts_per_rank``). Else the load is refused."""
    if coord.world == saved_world:
        if coord.rank not in entry.per_rank:
            plan.missing.append(key)
            return None
        return entry.per_rank.index(coord.rank)
    if _accepts_per_rank(plan.flat, path):
        return -1
    if not plan.strict:                 # left as it is, listed as missing
        plan.missing.append(key)
        return None
    raise StateMismatchError(_resize_message(plan.flat, key, path, saved_world, coord.world))


def _want_all_rows(plan: _LoadPlan, path: tuple, entry: Any, saved_world: int, want: Any) -> None:
    target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    want(entry, [((tuple(0 for _ in entry.shape), entry.shape), target)])
    plan.fresh_per_rank.append((path, entry, target, saved_world))


def _resize_message(flat: FlatState, key: str, path: tuple, saved: int, world: int) -> str:
    hint = next((getattr(a, "resize_hint", None) for p, a, _ in flat.statefuls if path[:len(p)] == p
                 and getattr(a, "resize_hint", None)), None)
    return (f"key {key!r} held a different value on each of the {saved} saving ranks; it cannot be mapped onto "
            f"{world} ranks; nothing was loaded. " + (hint or "Make it equal on all ranks, load with the same world "
                                                      "size, or pass strict=False to leave it as it is (it is "
                                                      "then listed in missing_keys)"))


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
