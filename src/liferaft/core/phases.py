"""The phases of a save, shared by ``save`` (sync) and ``async_save``.

prepare (flatten, exchange metadata, plan) → write this rank's chunks (directly, or from staged copies) →
finish (exchange hashes; rank 0 writes the manifest, then atomically the ``COMMIT`` marker; final exchange;
rank 0 removes files of the checkpoint it replaced). Every phase that can fail on one rank runs as a
``Coordinator.run`` step, so every rank raises when any rank fails (docs/FORMAT.md §8); a rank whose save fails
removes the files it wrote unless the checkpoint was committed.

Process-wide state: ``core.caches``: the last tensor layout planned per group, and the layouts whose own plans
rank 0 checked; bounded, all dropped by ``liferaft.release()``.
"""

from __future__ import annotations

import pickle
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from liferaft.core.base import (
    SharedBase,
    copy_gathered_crumbs,
    copy_own_crumbs,
    full_base,
    open_base,
    rank_base,
    shared_base,
    split_base,
)
from liferaft.core.caches import INFERRED, PLANS, TILED, Planned
from liferaft.core.chunks.writer import ChunkPolicy, WriteOutcome
from liferaft.core.commit import abandon, is_committed, remove_stale, write_commit
from liferaft.core.described import (
    fill_inferred,
    implied_of,
    infer_unknown,
    layout_digest,
    layouts_of,
    tensor_digest,
)
from liferaft.core.policy import chunk_policy
from liferaft.core.replicas import same_replicas
from liferaft.core.stages import known_stages, plan_stages, stage_digest, staged_before
from liferaft.core.tabled import build_index, replicated, write_table
from liferaft.dist import Coordinator
from liferaft.errors import CheckpointExistsError, InvalidStateError, StorageError
from liferaft.format.layout import COMMIT_MARKER, table_file_name
from liferaft.options import SaveOptions, SaveResult
from liferaft.planning.geometry import Box, check_chunks_tile
from liferaft.planning.layouts import Layout, layout_holders, plan_own, probe_ranks
from liferaft.planning.save_plan import (
    RankMeta,
    SavePlan,
    TensorMeta,
    ValueMeta,
    WriteItem,
    build_manifest,
    merge_containers,
    merge_values,
    per_rank_keys,
    plan_save,
    replan,
)
from liferaft.state.flatten import FlatState, flatten
from liferaft.state.values import digest_encoded, encode_value
from liferaft.storage import Storage


def _version() -> str:
    """The installed liferaft's version (recorded in the manifest), from the package metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liferaft")
    except PackageNotFoundError:            # run from a source tree that was never installed
        return "unknown"


def _rank_meta(rank: int, flat: FlatState, allow_pickle: bool, world: int = 1) -> RankMeta:
    tensors = tuple(TensorMeta(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype_name, shape=t.shape,
                               boxes=tuple(b for b, _ in t.parts)) for t in flat.tensors)
    values = []
    for key, path, v in flat.values:
        enc = encode_value(v, key, allow_pickle)
        values.append(ValueMeta(key=key, path=path, encoded=enc, digest=digest_encoded(enc)))
    digests = tuple((t.key, tensor_digest(t.parts[0][1])) for t in flat.tensors if t.compare) if world > 1 else ()
    return RankMeta(rank=rank, tensors=tensors, values=tuple(values), containers=tuple(flat.containers),
                    digests=digests)


def _per_rank_sources(plan: SavePlan, flat: FlatState, rank: int) -> dict[tuple[str, Box], torch.Tensor]:
    """This rank's tensor for each box it holds, as the plan describes it (a per-rank tensor: as the row
    ``[1, *shape]`` of the stored tensor)."""
    per_rank = plan.per_rank
    sources = {}
    for t in flat.tensors:
        ranks = per_rank.get(t.key)
        if ranks is None:
            sources.update(((t.key, box), local) for box, local in t.parts)
        elif rank in ranks:
            local = t.parts[0][1]
            sources[(t.key, (((ranks.index(rank),) + tuple(0 for _ in t.shape)), (1,) + t.shape))] = \
                local.unsqueeze(0)
    return sources


@dataclass
class PreparedSave:
    """What every later phase needs: the plan, this rank's writes and the tensors they come from."""

    storage: Storage
    plan: SavePlan
    save_id: str
    rank: int
    world: int
    sources: dict[tuple[str, Box], torch.Tensor]
    policy: ChunkPolicy
    timings: dict[str, float] = field(default_factory=dict)
    t_start: float = 0.0
    lossy: dict[str, dict[str, Any]] = field(default_factory=dict)
    copies: str | None = None       # this rank's file of chunks copied from a sibling checkpoint, if any
    #: planned on its own (``plan.own``), or gathered and committed with chunk tables: this rank's metadata, whose
    #: values and containers go to rank 0 (``_finish_own``), and the digest the ranks agreed on (0: gathered)
    own: RankMeta | None = None
    own_digest: int = 0
    #: (planned on its own) the digest of each of rank 0's values, by key
    zero_values: dict[str, str] = field(default_factory=dict)
    #: (planned on its own) each tensor's layout; ``tables``: the chunk records go to per-rank chunk tables
    #: (format version 4, ``core.tabled``): every layout regular, some tensor sharded (with every tensor held
    #: whole by every rank, as under DDP, one manifest lists the few chunks), nothing lossy,
    #: ``SaveOptions.chunk_tables``; or, planned gathered (``layouts`` None), some tensor sharded, more than one
    #: rank, nothing lossy, no incremental base: the index lists every chunk's box and rank (explicit boxes)
    layouts: tuple[Layout, ...] | None = None
    tables: bool = False
    #: (planned on its own, with an incremental base) the base as every rank received it
    base: SharedBase | None = None
    #: rank 0: the release of its hold on the folder (``Storage.lock_writer``), called once the save is over
    unlock: Callable[[], None] | None = None

    def release(self) -> None:
        """Let another save to this folder start (rank 0's lock; idempotent, never raises)."""
        unlock, self.unlock = self.unlock, None
        if unlock is not None:
            unlock()

    @property
    def explicit(self) -> bool:
        """(With ``tables``) whether the index lists every chunk's box and rank (explicit boxes): the plan was
        gathered, or made on each rank with a layout no reader can replay (a ``_StridedShard`` that is not a
        nested split: each rank sends rank 0 its boxes)."""
        return self.layouts is None or not all(la.regular for la in self.layouts)

    @property
    def writes(self) -> tuple[WriteItem, ...]:
        return self.plan.writes[self.rank]

    @property
    def my_file(self) -> str | None:
        return self.writes[0].file if self.writes else None

    def abandon(self) -> None:
        """Delete the files this rank wrote for this save (it failed; never raises)."""
        abandon(self.storage, self.my_file)
        abandon(self.storage, self.copies)
        if self.tables and self.writes:
            abandon(self.storage, table_file_name(self.save_id, self.rank))


def prepare_save(state: Any, coord: Coordinator, storage: Storage, opts: SaveOptions) -> PreparedSave:
    """Flatten, exchange metadata and plan (collective). Raises on every rank if any rank fails. Rank 0 holds the
    folder for this save from before anything is written (``Storage.lock_writer``: a second save to the same path
    raises CheckpointBusyError on every rank, never both committing over each other's files) until
    ``PreparedSave.release``, which the caller runs once the save is over."""
    held: list[Callable[[], None]] = []
    try:
        prepared = _prepare_save(state, coord, storage, opts, held)
    except BaseException:
        for unlock in held:
            unlock()
        raise
    prepared.unlock = held[0] if held else None
    return prepared


def _prepare_save(state: Any, coord: Coordinator, storage: Storage, opts: SaveOptions,
                  held: list[Callable[[], None]]) -> PreparedSave:
    """``prepare_save``; rank 0's folder lock appended to ``held``.

    When every rank describes the same tensors with the same compact layouts (``planning.layouts``: DTensors
    over a mesh of the ranks in order, plain tensors held whole), which one all-reduce of a digest tells, each
    rank plans its own writes and nothing is gathered; otherwise every rank's metadata is gathered and planned
    (``planning.save_plan``)."""
    t_start = time.perf_counter()
    flat: FlatState | None = None
    meta: RankMeta | None = None
    layouts: tuple[Layout | None, ...] | None = None
    cache_key = (coord.key, coord.rank, coord.world, opts.alignment, opts.chunk_bytes)
    cached = PLANS.get(cache_key)
    # (every rank of a group votes, whatever its options, so that all run the same collectives)
    compact = coord.world > 1 and coord.global_order
    # (an incremental save is planned on each rank too, unless an XOR delta or a selective save reads the base's
    # bytes: those are planned gathered)
    own_base = bool(opts.incremental_base) and not opts.delta and opts.selective is None
    base: tuple[str, Any] | None = None

    def describe() -> tuple[Any, ...]:
        """This rank's metadata to share (flattening ``state``, which is kept here)."""
        nonlocal flat, meta, layouts, base
        if sys.byteorder != "little":
            raise StorageError("liferaft stores little-endian bytes; big-endian hosts are not supported")
        if storage.process_local and coord.world > 1:
            raise StorageError(f"{storage.url} is process-local; a save from {coord.world} ranks needs a shared "
                               "backend (a local path, file:// or an object store)")
        flat = flatten(state, world=coord.world)
        meta = _rank_meta(coord.rank, flat, opts.allow_pickle, coord.world)
        if compact and (own_base or not opts.incremental_base):
            layouts = layouts_of(flat, coord.rank, coord.world)
        if coord.rank == 0 and not held:
            unlock = storage.lock_writer()
            if unlock is not None:
                held.append(unlock)
        if coord.rank == 0 and not opts.overwrite and storage.exists(COMMIT_MARKER):
            raise CheckpointExistsError(f"{storage.url} already holds a committed checkpoint; pass "
                                        "SaveOptions(overwrite=True) to replace it, or save to a new path")
        # tensors unchanged since the last save planned here: send only the values and the id of that plan
        reuse = cached[2] if cached is not None and cached[0] == meta.tensors else None
        if coord.rank == 0 and opts.incremental_base:   # (the index only, unless the plan is gathered)
            base = open_base(storage, opts.incremental_base, tables=False)
            if not compact:
                base = full_base(storage, base)
        return (replace(meta, tensors=()) if reuse else meta, uuid.uuid4().hex[:16] if coord.rank == 0 else None,
                reuse, base, (opts.chunk_tables, opts.alignment, opts.chunk_bytes),
                tuple(t.key for t in flat.tensors if t.implied))

    plan: SavePlan | None = None
    agreed = 0
    zero_values: dict[str, str] = {}
    if compact:
        cached_inferred: tuple[Layout, ...] | None = None
        sig = 0
        stage_opts = (opts.alignment, opts.chunk_bytes, opts.chunk_tables, own_base)

        def gathered_payload() -> tuple[Any, ...]:
            """``payload`` with rank 0's base whole (its chunk tables read), for a plan gathered after all."""
            return payload if base is None else (*payload[:3], full_base(storage, base), *payload[4:])

        def vote() -> tuple[tuple[Any, ...], list[int]]:
            nonlocal cached_inferred
            payload = describe()
            assert meta is not None and flat is not None
            nonlocal sig
            h = layout_digest(meta, layouts, opts.alignment, opts.chunk_bytes, opts.chunk_tables,
                              implied=implied_of(flat), incremental=own_base) if layouts is not None else 0
            need, known = 0, 0
            if layouts is not None and None in layouts:     # hand-made shards: their layouts are inferred
                shape_key = layout_digest(meta, layouts, opts.alignment, opts.chunk_bytes, values=False)
                cached_inferred = fill_inferred(layouts, INFERRED.get((coord.key, shape_key)), flat, coord.rank)
                need = int(cached_inferred is None)
                if cached_inferred is not None:
                    known = layout_digest(meta, cached_inferred, opts.alignment, opts.chunk_bytes, opts.chunk_tables)
            # (ranks that hold different tensors, each with a regular layout: pipeline stages, ``core.stages``)
            stageable = layouts is not None and all(la is not None and la.regular for la in layouts)
            if stageable and staged_before(coord):      # (else computed only if the stages are planned)
                sig = stage_digest(meta, cast("tuple[Layout, ...]", layouts), stage_opts, implied_of(flat))
            staged = known_stages(coord, sig) if sig else 0
            return payload, [h, -h, need, known, -known, int(not stageable), staged, -staged]

        payload, (high, neg_low, need, known, neg_known, unstageable, staged, neg_staged) = coord.run_max(
            vote, 8, "save (planning)")
        assert meta is not None and flat is not None
        if high != -neg_low and not unstageable:    # the ranks hold different tensors: planned by stages
            sig = sig or stage_digest(meta, cast("tuple[Layout, ...]", layouts), stage_opts, implied_of(flat))
            found = plan_stages(coord, flat, meta, cast("tuple[Layout, ...]", layouts), sig, staged == -neg_staged != 0,
                                (payload[1], {v.key: v.digest for v in meta.values}), stage_opts)
            if found is not None:
                tensors, layouts, agreed, (save_id, zero_values) = found
                plan = _own_plan(meta, layouts, coord, save_id, opts, cached, agreed, tensors)
            else:
                gathered = coord.exchange(gathered_payload(), None, "save (planning)")
        elif high == -neg_low != 0:                 # every rank sent the same digest of compact layouts
            assert layouts is not None
            unknown = [i for i, la in enumerate(layouts) if la is None]
            inferred, error = None, None
            if unknown and (need or known != -neg_known):   # infer them from the boxes of a few ranks
                probed, error = _gather_probes(coord, tuple(flat.tensors[i].parts[0][0] for i in unknown))
                if probed is not None:
                    try:
                        inferred = infer_unknown([flat.tensors[i].shape for i in unknown], probed, coord.world)
                    except Exception as e:  # noqa: BLE001 - reported to every rank by the broadcast
                        error = e
            # (with rank 0's values' digests: a rank sends rank 0 only the values that differ from rank 0's)
            save_id, zero_values, inferred = coord.broadcast_from_zero(
                (payload[1], {v.key: v.digest for v in meta.values}, inferred), error, "save (planning)")
            if error is not None:       # (a probe whose send failed; rank 0's receive failed too, or timed out)
                raise error
            if unknown:
                filled = cached_inferred if inferred is None and not need and known == -neg_known else \
                    fill_inferred(layouts, inferred, flat, coord.rank)
                if coord.all_max([int(filled is None)], "save (planning)")[0]:
                    layouts = None                  # some rank's box follows no inferred layout: gathered
                else:
                    assert filled is not None
                    INFERRED.put((coord.key, layout_digest(meta, layouts, opts.alignment, opts.chunk_bytes, values=False)),
                                 tuple(filled[i] for i in unknown))
                    layouts = filled
                    high = layout_digest(meta, layouts, opts.alignment, opts.chunk_bytes, opts.chunk_tables,
                                         implied=implied_of(flat), incremental=own_base)
            if layouts is not None:
                implied = implied_of(flat)      # (the same on every rank: in the digest)
                if implied:     # (replicas by a sub-mesh alone: compared; stages naming their layers alike refused)
                    chosen_layouts = cast("tuple[Layout, ...]", layouts)
                    at = {meta.tensors[i].key: i for i in implied}
                    same_replicas(coord, flat, list(at), lambda key: layout_holders(chosen_layouts[at[key]],
                                                                                    coord.rank))
                plan = _own_plan(meta, cast("tuple[Layout, ...]", layouts), coord, save_id, opts, cached, high)
                agreed = high
            else:
                gathered = coord.exchange(gathered_payload(), None, "save (planning)")
        else:
            gathered = coord.exchange(gathered_payload(), None, "save (planning)")
    else:
        gathered = coord.run(describe, "save (planning)")
    assert flat is not None and meta is not None
    if plan is None:
        save_id, base = gathered[0][1], gathered[0][3]
        if len({g[4] for g in gathered}) > 1:       # (they would plan or commit in different ways: refused alike)
            names = ("chunk_tables", "alignment", "chunk_bytes")
            which = [n for i, n in enumerate(names) if len({g[4][i] for g in gathered}) > 1]
            i = names.index(which[0])
            shown = [f"rank {r}: {g[4][i]}" for r, g in enumerate(gathered) if g[4][i] != gathered[0][4][i]][:7]
            raise InvalidStateError(f"the ranks passed different SaveOptions.{which[0]} (rank 0: {gathered[0][4][i]}, "
                                    + ", ".join(shown) + "); pass the same options on every rank")
        # (every rank sends its digests, also with a reused plan: which plain tensors are stored per rank may change)
        implied = sorted({k for g in gathered for k in g[5]})
        if cached is not None and all(g[2] == cached[2] for g in gathered) and \
                per_rank_keys([g[0] for g in gathered]) == cached[1].per_rank and cached[4:5] == (implied,):
            plan = replan(cached[1], [g[0] for g in gathered], save_id)
            holders = cached[3]
        else:
            if any(g[2] for g in gathered):     # some rank sent no tensor metadata: gather it all again
                gathered = coord.exchange((meta, None, None, None, (opts.chunk_tables, opts.alignment,
                                                                    opts.chunk_bytes), ()), None, "save (planning)")
            plan = plan_save([g[0] for g in gathered], save_id, opts.alignment, opts.chunk_bytes)
            holders = _box_holders([g[0] for g in gathered], flat, set(implied))
            PLANS.put(cache_key, (meta.tensors, plan, save_id, holders, implied))
        # (replicas by a sub-mesh alone: compared, so that stages naming their layers alike are refused)
        same_replicas(coord, flat, implied, holders.get)
    shared = None
    if plan.own and own_base:       # (every rank knows: planned on its own, with a base it may reference)
        shared = coord.broadcast_from_zero(shared_base(base), None, "save (incremental base)")
        if shared is not None:
            mine = coord.scatter_from_zero(split_base(base, coord.world) if coord.rank == 0 else None, None,
                                           "save (incremental base)")
            base = rank_base(storage, shared, mine, coord.rank)
    elif plan.own:
        base = None
    sources = _per_rank_sources(plan, flat, coord.rank)
    for w in plan.writes[coord.rank]:
        if w.parent is not None:
            sources[(w.key, (w.offsets, w.sizes))] = sub_view(sources[(w.key, w.parent)], w.parent,
                                                              (w.offsets, w.sizes))
    policy, lossy = chunk_policy(plan, storage, opts, base)
    own = layouts is not None and plan.own
    chosen = cast("tuple[Layout, ...]", layouts) if own else None
    if own:     # (a _StridedShard that is no nested split: explicit boxes, ``PreparedSave.explicit``)
        tables = opts.chunk_tables and not lossy and not all(replicated(la) for la in chosen or ())
    else:   # (gathered: explicit boxes, when some tensor is sharded and nothing refers to another checkpoint)
        tables = opts.chunk_tables and not lossy and base is None and coord.world > 1 and _sharded(plan)
    prepared = PreparedSave(storage=storage, plan=plan, save_id=save_id, rank=coord.rank, world=coord.world,
                            sources=sources, policy=policy, t_start=t_start, lossy=lossy,
                            own=meta if own or tables else None, own_digest=agreed, zero_values=zero_values,
                            layouts=chosen, tables=tables, base=shared)
    prepared.timings["plan"] = time.perf_counter() - t_start
    return prepared


def _box_holders(metas: list[RankMeta], flat: FlatState, keys: set[str]) -> dict[str, tuple[int, ...]]:
    """For each tensor of ``keys`` this rank holds, the ranks of ``metas`` holding the same boxes of it."""
    if not keys:
        return {}
    mine = {t.key: tuple(box for box, _ in t.parts) for t in flat.tensors if t.key in keys}
    out: dict[str, list[int]] = {k: [] for k in mine}
    for m in metas:
        for t in m.tensors:
            if t.key in mine and tuple(t.boxes) == mine[t.key]:     # (the same boxes: replicas)
                out[t.key].append(m.rank)
    return {k: tuple(r) for k, r in out.items()}


def _sharded(plan: SavePlan) -> bool:
    """Whether some rank of a gathered ``plan`` holds part of a tensor, not all of it."""
    whole = {t.key: (tuple(0 for _ in t.shape), t.shape) for t in plan.tensors}
    return any((w.parent or (w.offsets, w.sizes)) != whole[w.key] for writes in plan.writes for w in writes)


#: the tags of the probes' messages to rank 0 (``_gather_probes``; ``dist.GATHER_TAG`` and ``core.load``'s
#: span tags are 0x4C46_0001 to 0x4C46_0003)
PROBE_SIZE_TAG, PROBE_TAG = 0x4C46_0004, 0x4C46_0005


def probe_message(boxes: tuple[Box, ...]) -> bytes:
    """A probe's message: its boxes pickled, equal boxes as one object (pickle then sends a repeat as a
    reference: a model's thousand tensors of a few shapes cost a few kB)."""
    return pickle.dumps(_deduped(boxes), protocol=pickle.HIGHEST_PROTOCOL)


def _deduped(boxes: tuple[Box, ...]) -> tuple[Box, ...]:
    same: dict[Box, Box] = {}
    return tuple(same.setdefault(b, b) for b in boxes)


def _gather_probes(coord: Coordinator, boxes: tuple[Box, ...]) -> tuple[dict[int, Any] | None, BaseException | None]:
    """On rank 0, the boxes of the tensors of unknown layout held by each of ``planning.layouts.probe_ranks``
    (``boxes`` on each rank), sent point to point by the probes alone (a few dozen messages whatever the world);
    (None, None) on the other ranks. A failed send or receive is returned as the error (rank 0's goes to every
    rank with the broadcast that follows)."""
    try:
        return coord.gather_some(probe_ranks(coord.world), _deduped(boxes),
                                 (PROBE_SIZE_TAG, PROBE_TAG), "save (planning): the probes' boxes"), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by the broadcast that follows
        return None, e


def _own_plan(meta: RankMeta, layouts: tuple[Layout, ...], coord: Coordinator, save_id: str, opts: SaveOptions,
              cached: Planned | None, agreed: int, tensors: tuple[TensorMeta, ...] | None = None) -> SavePlan:
    """This rank's plan from compact layouts (``planning.layouts.plan_own``): its own writes only (the other
    ranks' are empty here), the global tensors as this rank describes them (``tensors``: those of every rank,
    when the ranks hold different ones: ``core.stages``); values and containers are merged on rank 0 at the
    commit. Reused from the cache when planned for the same digest."""
    cache_key = (coord.key, coord.rank, coord.world, opts.alignment, opts.chunk_bytes)
    if cached is not None and cached[0] == ("layouts", agreed):
        return replan(cached[1], [], save_id)
    tensors = meta.tensors if tensors is None else tensors
    mine = plan_own(list(zip(tensors, layouts)), coord.rank, save_id, opts.alignment, opts.chunk_bytes)
    writes = tuple(mine if r == coord.rank else () for r in range(coord.world))
    files = {mine[-1].file: mine[-1].byte_offset + mine[-1].length} if mine else {}
    plan = SavePlan(world_size=coord.world, writes=writes, files=files, tensors=tensors, values=(),
                    containers=(), own=True)
    PLANS.put(cache_key, (("layouts", agreed), plan, save_id))    # type: ignore[arg-type]
    return plan


def finish_save(coord: Coordinator, prep: PreparedSave, write: Callable[[], WriteOutcome],
                opts: SaveOptions) -> SaveResult:
    """Run ``write`` (this rank's chunks, durable on return), exchange hashes, commit on rank 0, agree; the
    checkpoint exists when this returns on any rank. If any rank fails, every rank raises, having removed the
    files it wrote unless the checkpoint was committed."""
    storage, save_id, plan = prep.storage, prep.save_id, prep.plan
    if prep.own is not None:
        return _finish_own(coord, prep, write, opts)
    outcomes = coord.run(write, "save (write)", cleanup=prep.abandon)
    stored, copied = copy_gathered_crumbs(coord, prep, [(o.chunks, o.file_size) for o in outcomes], opts)
    outcome = outcomes[coord.rank]
    timings = prep.timings
    timings.setdefault("stage", outcome.stage_s)
    timings["write"] = outcome.write_s
    timings["encode"] = outcome.encode_s
    t0 = time.perf_counter()

    def commit() -> None:
        if coord.rank != 0:
            return
        try:
            manifest = build_manifest(plan, [s[0] for s in stored], [s[1] for s in stored], save_id=save_id,
                                      created_unix=time.time(), liferaft_version=_version(),
                                      torch_version=torch.__version__, extra=opts.metadata, lossy=prep.lossy)
            write_commit(storage, save_id, manifest)
        except OSError as e:
            raise StorageError(f"{storage.url}: writing the manifest or the commit marker failed: {e}") from e

    def unless_committed() -> None:
        # A peer may have died after rank 0 committed: never delete files a committed checkpoint needs.
        if not is_committed(storage, save_id):
            prep.abandon()

    coord.run(commit, "save (commit)", cleanup=unless_committed)
    _after_commit(coord, prep, t0)
    return SaveResult(path=storage.url, save_id=save_id, world_size=coord.world, rank=coord.rank,
                      bytes_written=outcome.bytes_written + copied[prep.rank][0],
                      total_bytes=sum(s[1] for s in stored) + sum(c[0] for c in copied),
                      files=sum(1 for s in stored if s[1]) + sum(1 for c in copied if c[0]), timings=timings,
                      bytes_reused=outcome.bytes_reused - copied[prep.rank][1],
                      bytes_encoded=outcome.bytes_encoded)


def _finish_own(coord: Coordinator, prep: PreparedSave, write: Callable[[], WriteOutcome], opts: SaveOptions
                ) -> SaveResult:
    """``finish_save`` of a plan each rank made on its own: each rank's writes, what it stored, its values (those
    equal to rank 0's by digest as their key only) and containers go to rank 0 only
    (``Coordinator.gather_to_zero``), which writes the manifest and commits; the other ranks learn the outcome
    from one broadcast. With an incremental base (``prep.base``), one all-reduce after the writes decides which
    older checkpoints are referenced and which crumbs are copied (``core.base.crumbs``)."""
    storage, save_id, plan, meta = prep.storage, prep.save_id, prep.plan, prep.own
    assert meta is not None
    result, error, table = None, None, None
    copied = raw = 0
    try:
        result = write()
    except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised here too
        error = e
    if prep.base is not None:       # (every rank takes part, also one whose write failed)
        result, error, copied, raw = copy_own_crumbs(coord, prep, result, error, opts)
    try:
        if error is None and result is not None and prep.tables and prep.writes:
            table = write_table(storage, save_id, prep.rank, plan, None if prep.explicit else prep.layouts,
                                prep.writes, result.chunks)
    except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised here too
        error = e
    values = tuple(v.key if prep.zero_values.get(v.key) == v.digest else v for v in meta.values)  # (key: rank 0's)
    if prep.tables:             # (the table's reference instead of every chunk's record)
        wrote = sum(w.length for w in prep.writes)
        ref, size, inline = table or (None, 0, [])
        # (explicit boxes of a plan made on each rank: this rank's boxes, which rank 0 does not know)
        boxes = [(w.key, w.offsets, w.sizes) for w in prep.writes] if prep.explicit and prep.layouts else None
        # (the files of older checkpoints its chunks lie in, and its file of copied chunks, with their sizes)
        others = {} if result is None else {f: n for sc in result.chunks for f, n in (sc.ref_files or {}).items()}
        row = None if result is None else ((ref, size, result.file_size, wrote, inline, boxes, others), (), 0,
                                           values, meta.containers)
    else:
        row = None if result is None else (prep.writes, result.chunks, result.file_size, values, meta.containers)
    try:
        rows = coord.gather_to_zero(row, error, "save (write)")
    except BaseException:
        prep.abandon()
        raise
    assert result is not None
    timings = prep.timings
    timings.setdefault("stage", result.stage_s)
    timings["write"] = result.write_s
    timings["encode"] = result.encode_s
    t0 = time.perf_counter()
    summary, error = None, None
    if rows is not None:
        try:
            zero = {v.key: v for v in meta.values}
            metas = [RankMeta(rank=r, tensors=(), values=tuple(zero[x] if isinstance(x, str) else x for x in v),
                              containers=c) for r, (_, _, _, v, c) in enumerate(rows)]
            merged: dict[str, Any] = {"values": tuple(merge_values(metas)), "containers": merge_containers(metas)}
            if prep.tables:
                manifest = build_index(plan, None if prep.explicit else prep.layouts, [w for w, *_ in rows],
                                       save_id=save_id,
                                       created_unix=time.time(), liferaft_version=_version(),
                                       torch_version=torch.__version__, extra=dict(opts.metadata),
                                       alignment=opts.alignment, chunk_bytes=opts.chunk_bytes, **merged)
                sizes = [w[2] + sum(n for f, n in w[6].items() if not f.startswith("../")) for w, *_ in rows]
            else:
                full = replace(plan, writes=tuple(w for w, *_ in rows), **merged)
                if TILED.get((coord.key, prep.own_digest)) is None:
                    _check_tiles(full)
                    TILED.put((coord.key, prep.own_digest), True)
                manifest = build_manifest(full, [s for _, s, *_ in rows], [n for _, _, n, *_ in rows],
                                          save_id=save_id, created_unix=time.time(), liferaft_version=_version(),
                                          torch_version=torch.__version__, extra=opts.metadata, lossy=prep.lossy)
                sizes = [n + sum(n for sc in s for f, n in (sc.ref_files or {}).items() if f.endswith("-copies.bin"))
                         for _, s, n, *_ in rows]
            write_commit(storage, save_id, manifest)
            summary = (sum(sizes), sum(1 for n in sizes if n))
        except OSError as e:
            error = StorageError(f"{storage.url}: writing the manifest or the commit marker failed: {e}")
        except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised here too
            error = e
    try:
        total, files = coord.broadcast_from_zero(summary, error, "save (commit)")
    except BaseException:
        if not is_committed(storage, save_id):      # never delete files a committed checkpoint needs
            prep.abandon()
        raise
    _after_commit(coord, prep, t0)
    return SaveResult(path=storage.url, save_id=save_id, world_size=coord.world, rank=coord.rank,
                      bytes_written=result.bytes_written + copied, total_bytes=total, files=files, timings=timings,
                      bytes_reused=result.bytes_reused - raw, bytes_encoded=result.bytes_encoded)


def _after_commit(coord: Coordinator, prep: PreparedSave, t0: float) -> None:
    """Once every rank knows the save committed: rank 0 removes the files of the checkpoint it replaced (a
    failure is a warning); the commit's and the save's times are recorded."""
    if coord.rank == 0:
        try:
            remove_stale(prep.storage, keep=prep.save_id)
        except OSError as e:
            warnings.warn(f"{prep.storage.url}: checkpoint committed, but removing files of the checkpoint it "
                          f"replaced failed ({e}); they are unused and can be deleted", stacklevel=3)
    prep.timings["commit"] = time.perf_counter() - t0
    prep.timings["total"] = time.perf_counter() - prep.t_start


def _check_tiles(plan: SavePlan) -> None:
    """Raise InvalidStateError unless the chunks of ``plan`` (every rank's writes, gathered) tile every tensor:
    what rank 0 checks before it commits the first save of a layout planned by each rank on its own (the
    boxes of a ``_StridedShard`` come from DTensor, not from ``planning.layouts``)."""
    boxes: dict[str, list[Box]] = {t.key: [] for t in plan.tensors}
    for items in plan.writes:
        for w in items:
            if w.key not in boxes:
                raise InvalidStateError(f"key {w.key!r}: a rank planned to write a tensor the others do not hold")
            boxes[w.key].append((w.offsets, w.sizes))
    for t in plan.tensors:
        problem = check_chunks_tile(t.shape, boxes[t.key])
        if problem:
            raise InvalidStateError(f"key {t.key!r}: {problem}; the ranks' own plans do not tile the tensor (its "
                                    "DTensor placements give the ranks overlapping or missing parts)")


def sub_view(local: torch.Tensor, held: Box, box: Box) -> torch.Tensor:
    """The part of ``local`` (this rank's tensor for the box ``held``) that covers ``box`` inside it."""
    view = local
    for d, (o, h, n) in enumerate(zip(box[0], held[0], box[1])):
        view = view.narrow(d, o - h, n)
    return view
