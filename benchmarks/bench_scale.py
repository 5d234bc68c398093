"""Planning at scale, in one process: what the first save's plan and a resharding load's plan cost per rank as the
job grows, side by side with PyTorch DCP's own planner on the same simulated metadata (issue #20's baseline).

Simulated jobs of ``--ranks`` ranks, each holding its part of ``--tensors`` tensors of ``--rows`` × 4096 fp32
(``--rows`` grown to at least the rank count so that every rank holds a row), in these layouts:

- ``fsdp`` — every tensor ``Shard(0)`` over all ranks (FSDP2: one row block per rank);
- ``fsdp×tp8`` — ``Shard(0)`` over ranks / 8 and ``Shard(1)`` over 8 (a 2-D grid);
- ``pairs`` — hand-made row shards over ranks / 2, each held by 2 ranks (replicas);
- ``ddp`` — every rank holds every tensor whole (replicated; one rank writes each chunk).

Measured (median of ``--reps``): liferaft's ``plan_save`` over the gathered metadata (what every rank runs for
the first save today), the bytes of one rank's metadata and of everyone's (what each rank receives), the
manifest's JSON size (``build_manifest`` with one 4 MiB hash block per chunk); liferaft's ``plan_reads`` for one
rank of a resharding load onto ¾ of the ranks (``fsdp`` only); DCP's ``dedup_save_plans`` +
``create_default_global_save_plan`` over the same shards (its coordinator's global plan) and the pickled size of
its ``Metadata`` (what every loading rank reads). DCP's local load plan needs real DTensors (a process group) and
is not simulated here. A cell that would take longer than ``--budget-s`` (estimated from the smaller sizes, growing as
ranks²) is skipped.

A second table: the plan each rank makes on its own when every tensor has a compact layout (``planning.layouts``;
for ``pairs``, hand-made shards, the layout inferred from the boxes of a few ranks, timed in a third table): one rank's time to digest its layouts and plan its writes, at ``--own-ranks`` ×
``--own-tensors``; the bytes it receives to plan (the digest vote and the save id); the commit with chunk tables
(format version 4: ``core.tabled``): its row of the gather to rank 0, rank 0's total, the index's size and one
rank's table's; one rank of a load onto ¾ of the ranks planned for real from files (the index decoded, the
tables it needs found, read, checked; its reads planned) and how many tables it read; and (``fsdp``) what each
rank receives in a load's planning exchange (modelled from its payload, 8 ranks per host).

    python benchmarks/bench_scale.py [--ranks 256,1024,4096] [--tensors 100] [--layouts fsdp,fsdp×tp8,pairs,ddp]
"""

from __future__ import annotations

import argparse
import datetime
import math
import pickle
import statistics
import time
from typing import Any

from _common import machine  # sets up the paths


def compact_tensors_of(layout: str, ranks: int, tensors: int, rows: int) -> Any:
    from liferaft.testing.scale import compact_tensors

    return compact_tensors(layout, ranks, tensors, rows)

COLS = 4096            # (liferaft.testing.scale.COLS)


def _metas(layout: str, ranks: int, tensors: int, rows: int) -> list[Any]:
    from liferaft.testing.scale import rank_metas

    return rank_metas(layout, ranks, tensors, rows)


def _liferaft_save(metas: list[Any]) -> tuple[float, Any]:
    from liferaft.planning.save_plan import plan_save

    t0 = time.perf_counter()
    plan = plan_save(metas, "0" * 16)
    return time.perf_counter() - t0, plan


def _manifest_bytes(plan: Any) -> int:
    from liferaft.core.chunks.writer import StoredChunk
    from liferaft.planning.save_plan import build_manifest

    block = 4 << 20
    stored = [[StoredChunk(file=w.file, byte_offset=w.byte_offset, block_size=block,
                           hashes=tuple("0" * 8 for _ in range(max(1, -(-w.length // block)))))
               for w in items] for items in plan.writes]
    sizes = [sum(w.length for w in items) for items in plan.writes]
    m = build_manifest(plan, stored, sizes, save_id="0" * 16, created_unix=0.0, liferaft_version="0",
                       torch_version="0")
    return len(m.to_json_bytes())


def _boxes_index_bytes(plan: Any) -> int:
    """The JSON size of the version 4 index with explicit boxes of a gathered ``plan`` (``core.tabled.build_index``
    without layouts: every chunk's box and rank; its records live in the ranks' tables)."""
    from liferaft.core.tabled import build_index
    from liferaft.format.layout import table_file_name
    from liferaft.format.manifest import TableRef

    rows = [(TableRef(file=table_file_name("0" * 16, r), rank=r, hash="0" * 16, chunks=len(items)) if items else None,
             1000, sum(w.length for w in items), sum(w.length for w in items), [])
            for r, items in enumerate(plan.writes)]
    m = build_index(plan, None, rows, save_id="0" * 16, values=(), containers=(), created_unix=0.0,
                    liferaft_version="0", torch_version="0", extra={}, alignment=64, chunk_bytes=16 << 20)
    return len(m.to_json_bytes())


def _liferaft_load(plan: Any, ranks: int, rows: int, tensors: int, to_tp: bool = False) -> float:
    """One rank's read plan for an ``fsdp`` load onto ¾ of the ranks (the rank in the middle), or (``to_tp``)
    onto the same ranks as FSDP × TP 8."""
    from liferaft.format.records import ChunkRecord, TensorEntry
    from liferaft.planning.load_plan import plan_reads

    rows = max(rows, ranks)
    if to_tp:
        dp, r = max(1, ranks // 8), ranks // 2
        lo, hi = (r // 8) * rows // dp, (r // 8 + 1) * rows // dp
        cols = (r % 8 * COLS // 8, COLS // 8)
    else:
        new = max(1, ranks * 3 // 4)
        r = new // 2
        lo, hi = r * rows // new, (r + 1) * rows // new
        cols = (0, COLS)
    entries = []
    for t in plan.tensors:
        chunks = tuple(ChunkRecord(offsets=b[0], sizes=b[1], file="f", byte_offset=0, length=b[1][0] * b[1][1] * 4,
                                   block_size=4 << 20, hashes=("0" * 8,) * max(1, -(-(b[1][0] * b[1][1] * 4)
                                                                                 // (4 << 20))))
                       for b in t.boxes)
        entries.append(TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape, chunks=chunks))
    wanted = [(0, ((lo, cols[0]), (hi - lo, cols[1])))]
    t0 = time.perf_counter()
    for e in entries[:tensors]:
        plan_reads(e, wanted)
    return time.perf_counter() - t0


def _dcp_plans(layout: str, ranks: int, tensors: int, rows: int) -> list[Any]:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    plans = []
    for meta in _metas(layout, ranks, tensors, rows):
        items = []
        for t in meta.tensors:
            (off, size), = t.boxes
            items.append(WriteItem(index=MetadataIndex(t.key, torch.Size(off)), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off),
                                                                                         torch.Size(size)),
                                                               properties=props, size=torch.Size(t.shape))))
        plans.append(SavePlan(items))
    return plans


def _dcp_save(plans: list[Any]) -> tuple[float, Any]:
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    t0 = time.perf_counter()
    deduped = dedup_save_plans(plans)
    _, metadata = create_default_global_save_plan(deduped)
    return time.perf_counter() - t0, metadata


def _own(layout: str, ranks: int, tensors: int, rows: int) -> tuple[float, int, int] | None:
    """Planned by each rank on its own (``planning.layouts``): one rank's time to digest its layouts and plan its
    writes (the middle rank), the bytes it receives to plan (the digest vote and the save id; for ``pairs`` also
    the inferred layouts in that broadcast and the all-reduce of the ranks' checks), and the bytes of its row of
    the commit's gather to rank 0 (its writes with their stored records). None: no compact layout."""
    from liferaft.core.chunks.writer import StoredChunk
    from liferaft.core.described import layout_digest as _layout_digest
    from liferaft.planning.layouts import layout_box, plan_own
    from liferaft.planning.save_plan import RankMeta
    from liferaft.testing.scale import compact_tensors

    described = compact_tensors(layout, ranks, tensors, rows)
    if described is None:
        return None
    rank = ranks // 2
    meta = RankMeta(rank=rank, tensors=tuple(t for t, _ in described), values=(), containers=())
    t0 = time.perf_counter()
    _layout_digest(meta, tuple(la for _, la in described), 64, 16 << 20)
    if layout == "pairs":           # (the rank checks its box against each inferred layout)
        for t, la in described:
            layout_box(la, t.shape, rank)
    mine = plan_own(described, rank, "0" * 16, 64, 16 << 20)
    dt = time.perf_counter() - t0
    inferred = tuple(la for _, la in described) if layout == "pairs" else None
    received = 8 * 9 + _broadcast(len(pickle.dumps((None, "0" * 16, {}, inferred))))   # all-reduce of 9 int64; the broadcast
    if layout == "pairs":
        received += 8
    block = 4 << 20
    stored = [StoredChunk(file=w.file, byte_offset=w.byte_offset, block_size=block,
                          hashes=tuple("0" * 8 for _ in range(max(1, -(-w.length // block))))) for w in mine]
    row = len(pickle.dumps((mine, stored, sum(w.length for w in mine), (), ())))
    return dt, received, row


def _inference(ranks: int, tensors: int, rows: int) -> tuple[float, int, int]:
    """Hand-made shards (``pairs``): rank 0's time to infer every tensor's layout from the probes' boxes
    (``core.described.infer_unknown``), the bytes rank 0 receives for it (each probe's message, sent point to
    point: ``core.phases.probe_message`` and its length), and the number of probes."""
    from liferaft.core.described import infer_unknown
    from liferaft.core.phases import probe_message
    from liferaft.planning.layouts import probe_ranks
    from liferaft.testing.scale import rank_box

    probes = probe_ranks(ranks)
    probed = {r: tuple(rank_box("pairs", ranks, rows, r) for _ in range(tensors)) for r in probes}
    t0 = time.perf_counter()
    got = infer_unknown([(max(rows, ranks), COLS)] * tensors, probed, ranks)
    dt = time.perf_counter() - t0
    assert all(la is not None for la in got)
    received = sum(8 + len(probe_message(m)) for r, m in probed.items() if r)
    return dt, received, len(probes)


def _stages(ranks: int, tensors: int, rows: int) -> tuple[float, int, float, int]:
    """Pipeline stages (``pp16``, ``planning.stages``): rank 0's time to merge the stages' descriptions and the
    bytes it receives (the gather of 8 bytes a rank, one message from the first rank of each stage); one rank's
    time to digest what it describes, scope every stage's layouts and plan its writes over them, and the bytes it
    receives to plan (the vote; the broadcasts of the classes, run-length encoded, and of every stage's tensors;
    the all-reduce that compares the copies of the tensors held whole, two numbers each, about twice the vector
    for a ring)."""
    import numpy as np

    from liferaft.core.stages import stage_digest
    from liferaft.planning.layouts import Layout, plan_own
    from liferaft.planning.save_plan import RankMeta
    from liferaft.planning.stages import classes_of, merge_stages, runs, stage_layouts
    from liferaft.testing.scale import STAGES, stage_tensors

    dp, opts = ranks // STAGES, (64, 16 << 20, True, False)

    def described(rank: int) -> tuple[Any, tuple[Any, ...]]:
        metas = stage_tensors(ranks, tensors, rows, rank)
        return metas, tuple(Layout((STAGES, dp), (None, 0)) if t.shape else Layout((ranks,), (None,))
                            for t in metas)

    descs = [(*described(s * dp), (), opts) for s in range(STAGES)]
    sigs = np.repeat(np.array([stage_digest(RankMeta(s * dp, d[0], (), ()), d[1], opts) for s, d in
                               enumerate(descs)], dtype=np.int64), dp)
    t0 = time.perf_counter()
    merged = merge_stages(descs, classes_of(sigs)[0])
    t_merge = time.perf_counter() - t0
    assert not isinstance(merged, str), merged
    to_zero = sum(16 + len(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL)) for d in descs[1:])
    rank = ranks // 2
    metas, lays = described(rank)
    t0 = time.perf_counter()
    stage_digest(RankMeta(rank, metas, (), ()), lays, opts)
    class_of, _ = classes_of(sigs)
    scoped = stage_layouts(merged, class_of)
    plan_own(list(zip(merged.tensors, scoped)), rank, "0" * 16, 64, 16 << 20)
    dt = time.perf_counter() - t0
    whole = sum(1 for la in scoped if all(d is None for d in la.shards))
    numbered = pickle.dumps((None, (*runs(class_of), list(range(0, ranks, dp)), 1 << 61)),
                            protocol=pickle.HIGHEST_PROTOCOL)
    received = 2 * 9 * 8 + _broadcast(len(numbered)) + _broadcast(len(pickle.dumps((None, (("0" * 16, {}), merged)),
                                                                                   protocol=pickle.HIGHEST_PROTOCOL))) \
        + 2 * 8 * (2 * whole + 1)
    return t_merge, to_zero + 8 * ranks, dt, received


def _tabled(layout: str, ranks: int, tensors: int, rows: int, tmp: str, to_tp: bool = False,
            incremental: dict[str, float] | None = None, windows: dict[str, float] | None = None
            ) -> tuple[int, int, int, float, int, float]:
    """A save with chunk tables (format version 4) of these tensors: the bytes of the middle rank's row of the
    commit's gather to rank 0, of the index (the manifest), of the middle rank's chunk table; then the middle rank
    of a load onto ¾ of the ranks (``fsdp``, ``fsdp×tp8``: its row block of every tensor; ``ddp``: every tensor
    whole; ``to_tp``: the middle rank of the same ranks as FSDP × TP 8, its row block of its column block)
    planned for real: decode the index, find the tables it needs (``core.tabled.TableSource``), read,
    check and decode them from files, check coverage, plan its reads. Returns (row, index, table, load plan s,
    tables read, of which index decode s). ``incremental``: filled with what an incremental save on this
    checkpoint as its base costs (``core.base``): rank 0 decodes the index and splits it (s), the bytes every rank
    receives (the broadcast tensors, and the middle rank's own part), the middle rank's read of its own table of
    the base (s), and the bytes a reference adds to the index per rank. ``windows``: every table written, then
    filled with what the tools' reads of every chunk record cost (``NativeReader.read_order``): with every table
    read into memory at once, and by windows of keys (``windows["chunks"]`` records each): seconds and peak
    Python memory (tracemalloc, in a second run: tracing slows it)."""
    import os

    from liferaft.codecs.checksum import digest
    from liferaft.core.chunks.writer import StoredChunk
    from liferaft.core.tabled import TableSource, build_index, replicated
    from liferaft.format.layout import data_file_name, table_file_name
    from liferaft.format.manifest import TableRef, decode_manifest
    from liferaft.format.tables import encode_table
    from liferaft.planning.geometry import numel
    from liferaft.planning.layouts import group_writers, plan_own
    from liferaft.planning.load_plan import plan_reads
    from liferaft.planning.save_plan import SavePlan, WriteItem, chunk_record
    from liferaft.storage import resolve

    described = compact_tensors_of(layout, ranks, tensors, rows)
    sid, block, cb = "0" * 16, 4 << 20, 16 << 20
    layouts = [la for _, la in described]
    plan = SavePlan(world_size=ranks, writes=(), files={}, tensors=tuple(t for t, _ in described), values=(),
                    containers=(), own=True)
    pos = {t.key: i for i, (t, _) in enumerate(described)}

    def stored(w: WriteItem) -> Any:
        return chunk_record(w, StoredChunk(file=w.file, byte_offset=w.byte_offset, block_size=block,
                                           hashes=tuple("0" * 8 for _ in range(-(-w.length // block)))))

    def table(rank: int) -> tuple[bytes, int, int, list[Any]]:
        mine = plan_own(described, rank, sid, 64, cb)
        recs = [(pos[w.key], stored(w)) for w in mine]
        return (encode_table(sid, rank, [(i, c) for i, c in recs if not replicated(layouts[i])]),
                mine[-1].byte_offset + mine[-1].length if mine else 0, sum(w.length for w in mine),
                [(i, c) for i, c in recs if replicated(layouts[i])])

    mid = ranks // 2
    data, fsize, wrote, inline = table(mid)
    ref = TableRef(file=table_file_name(sid, mid), rank=mid, hash=digest(data), chunks=data.count(b'"offsets"'))
    row = len(pickle.dumps(((ref, len(data), fsize, wrote, inline), (), 0, (), ())))
    # every replicated tensor's chunks, by writer (listed in the index)
    listed: dict[int, list[Any]] = {}
    firsts = sorted({la.group[0] for la in layouts if la.group})    # (pp16: each stage's tensors held whole)
    writers = [w for f in firsts for g in group_writers(described, f, cb, whole=True).values() for w in g.items()] \
        if firsts else list(next(iter(group_writers(described, 0, cb).values())).items()) \
        if any(replicated(la) for la in layouts) else []
    if writers:
        for (i, box), w in writers:
            t = described[i][0]
            n = numel(box[1]) * 4
            listed.setdefault(w, []).append((i, stored(WriteItem(key=t.key, offsets=box[0], sizes=box[1],
                                                                 file=data_file_name(sid, w), byte_offset=0,
                                                                 length=n))))
    total = sum(math.prod(t.shape) * 4 for t, _ in described)
    new = max(1, ranks * 3 // 4)
    r = new // 2
    full_rows = described[0][0].shape[0]
    lo, hi = (r * full_rows // new, (r + 1) * full_rows // new) if layout != "ddp" else (0, full_rows)
    col, width = 0, described[0][0].shape[1]
    if to_tp:
        dp, r = max(1, ranks // 8), ranks // 2
        lo, hi = (r // 8) * full_rows // dp, (r // 8 + 1) * full_rows // dp
        col, width = r % 8 * width // 8, width // 8
    wanted_boxes = [(t.key, ((lo, col), (hi - lo, width))) for t, _ in described if len(t.shape) == 2]
    actual: dict[int, tuple[bytes, int]] = {}

    def index_bytes() -> bytes:
        has = not all(replicated(la) for la in layouts)
        rows_ = [(TableRef(file=table_file_name(sid, q), rank=q,
                           hash=digest(actual[q][0]) if q in actual else ref.hash,
                           chunks=actual[q][0].count(b'"offsets"') if q in actual else ref.chunks) if has else None,
                  len(actual[q][0]) if q in actual else len(data), actual[q][1] if q in actual else max(fsize, 1),
                  total // ranks + (total % ranks if q == 0 else 0), listed.get(q, [])) for q in range(ranks)]
        return build_index(plan, layouts, rows_, save_id=sid, values=(), containers=(), created_unix=0.0,
                           liferaft_version="0", torch_version="0", extra={}, alignment=64,
                           chunk_bytes=cb).to_json_bytes()
    storage = resolve(tmp)
    probe = TableSource(storage, decode_manifest(index_bytes()), None)
    need: set[int] = set()
    for key, box in wanted_boxes:
        need |= probe.writers(key, box)
    if windows is not None:
        need = set(range(ranks))
    for w in need:                          # write the tables the load reads, with the index pinning them
        d, fs, _, _ = table(w)
        os.makedirs(os.path.dirname(os.path.join(tmp, table_file_name(sid, w))), exist_ok=True)
        with open(os.path.join(tmp, table_file_name(sid, w)), "wb") as f:
            f.write(d)
        actual[w] = (d, fs)
    raw = index_bytes()
    t0 = time.perf_counter()
    index = decode_manifest(raw)
    t_index = time.perf_counter() - t0
    src = TableSource(storage, index, None)
    got: set[int] = set()
    for key, box in wanted_boxes:
        got |= src.writers(key, box)
    src.fetch(got)
    for key, box in wanted_boxes:
        entry = src.entry(src.pos[key])
        src.check_covered(entry, box)
        plan_reads(entry, [(0, box)])
    t_load = time.perf_counter() - t0
    if windows is not None:
        _tool_windows(storage, index, windows)
    if incremental is not None:
        from liferaft.core.base import rank_base, shared_base, split_base

        os.makedirs(os.path.dirname(os.path.join(tmp, "base", table_file_name(sid, mid))), exist_ok=True)
        with open(os.path.join(tmp, "base", table_file_name(sid, mid)), "wb") as f:
            f.write(data)
        actual[mid] = (data, fsize)
        raw = index_bytes()
        t0 = time.perf_counter()
        base = decode_manifest(raw)
        t1 = time.perf_counter()
        shared, parts = shared_base(("base", base)), split_base(("base", base), ranks)
        incremental["zero_s"] = time.perf_counter() - t0
        incremental["split_s"] = time.perf_counter() - t1
        sent = pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL)
        part = pickle.dumps(parts[mid], protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.perf_counter()
        name, view = rank_base(resolve(os.path.join(tmp, "new")), pickle.loads(sent), pickle.loads(part), mid)
        incremental["rank_s"] = time.perf_counter() - t0
        incremental["received"] = len(sent) + len(part)
        incremental["chunks"] = sum(len(t.chunks) for t in view.tensors)
        incremental["per_rank_index"] = len(f'"../{name}/{data_file_name(sid, mid)}":{fsize},')
    return row, len(raw), len(data), t_load, len(got), t_index


def _tool_windows(storage: Any, index: Any, out: dict[str, float]) -> None:
    """Every chunk record of ``index``'s tables read as a tool reads them: all at once (``TableSource.fetch`` of
    every table), then by windows of consecutive tensors of about ``out["chunks"]`` records (a fresh
    ``TableSource`` per window, keeping its tensors' records only). Each in a forked process: its seconds and
    how much its peak resident memory grew (``ru_maxrss``). Fills them and the windows."""
    import multiprocessing
    import resource

    from liferaft.core.tabled import TableSource

    def run(window: int | None, q: Any) -> None:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        n = len(index.tensors)
        start, count, kept = 0, 0, []
        while start < n:
            src = TableSource(storage, index, None)
            keep, held = [], 0
            for pos in range(start, n):
                est = src.estimate(pos)
                if window is not None and keep and held + est > window:
                    break
                keep.append(pos)
                held += est
            ranks: set[int] = set()
            for pos in keep:
                t = index.tensors[pos]
                ranks |= src.writers(t.key, ((0,) * len(t.shape), t.shape))
            src.fetch(ranks, keep=set(keep))
            kept = [src.entry(p) for p in keep]         # (what a tool holds while it reads the window's keys)
            start, count = keep[-1] + 1, count + 1
            del src
        del kept
        q.put((time.perf_counter() - t0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, count))

    ctx = multiprocessing.get_context("fork")
    for name, window in (("all", None), ("win", int(out["chunks"]))):
        q = ctx.Queue()
        proc = ctx.Process(target=run, args=(window, q))
        proc.start()
        out[f"{name}_s"], out[f"{name}_peak"], count = q.get()
        proc.join()
        if window is not None:
            out["windows"] = count


def _broadcast(n: int) -> int:
    """Bytes a rank receives in a broadcast of an ``n``-byte message (``Coordinator._broadcast_bytes``): a first
    round of ``BROADCAST_HEAD`` bytes (the length, then the message's first bytes), the rest in a second."""
    from liferaft.dist.wire import BROADCAST_HEAD, LEN

    return max(BROADCAST_HEAD, LEN + n)


#: ranks per host in the model of a load's planning exchange
HOST_RANKS = 8


def _load_exchange(ranks: int, tensors: int) -> int:
    """The bytes each rank receives in a load's planning exchange (``core.load``, the default "host" sharing mode)
    when every rank loads its own row shard of ``tensors`` tensors saved FSDP-style (one span per tensor): one
    all-reduce of a number per key and four more (the keys some rank loads, the sharing mode, whether any rank
    misses or skips keys; a ring all-reduce receives about twice the vector), its host's ranks
    (``Coordinator.peers_alike``: each rank's host id gathered to rank 0, 8 bytes, then each rank sent its host's
    ranks: the scatter's size, then the pickled group), and the read spans of the other ``HOST_RANKS - 1`` ranks of
    its host, exchanged among them."""
    vote = 2 * (1 + tensors + 4) * 8
    first = ranks // 2 // HOST_RANKS * HOST_RANKS
    host = 8 + len(pickle.dumps(tuple(range(first, first + HOST_RANKS)), protocol=pickle.HIGHEST_PROTOCOL))
    spans = ([(f"data/{'0' * 16}/r{ranks // 2:05d}.bin", i << 20, 1 << 20) for i in range(tensors)], ("x" * 64, {}))
    return vote + host + len(pickle.dumps(spans, protocol=pickle.HIGHEST_PROTOCOL)) * (HOST_RANKS - 1)


def _own_table(sizes: list[int], counts: list[int], layouts: list[str], rows: int) -> None:
    import tempfile

    print()
    print("Planned by each rank on its own (one rank: digest + plan_own; what it receives to plan); committed with "
          "chunk tables (format version 4; DDP, every tensor held whole, keeps one manifest): that rank's row of "
          "the commit's gather to rank 0 and rank 0's total, the index, one rank's table; one rank of a load onto "
          "¾ of the ranks: its plan (index decode + tables found, read, checked + read plan), the tables it read:")
    print("| layout | ranks | tensors | plan, one rank (s) | received to plan (B) | row to rank 0 (B) | "
          "rank 0 gathers (MB) | index (MB) | one table (kB) | load plan, one rank → ¾ ranks (s) | tables read | "
          "load plan → FSDP × TP 8 (s) (tables read) | a load's planning exchange, received per rank (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        for ranks in sizes:
            for tensors in counts:
                got = _own(layout, ranks, tensors, rows)
                if got is None:
                    print(f"| {layout} | {ranks} | {tensors} | gathered (no compact layout) |||||||||")
                    continue
                dt, received, row = got
                if layout == "pp16":        # (planned by stages: ``_stages``)
                    _, _, dt, received = _stages(ranks, tensors, rows)
                loading = f"{_load_exchange(ranks, tensors) / 1e6:.1f}" if layout == "fsdp" else "–"
                if layout == "ddp":         # (one manifest: the v3 row, every chunk's record)
                    print(f"| {layout} | {ranks} | {tensors} | {dt:.3f} | {received} | {row} | "
                          f"{row * ranks / 1e6:.0f} | one manifest | – | – | – | – | – |", flush=True)
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    trow, index, table, t_load, read, _ = _tabled(layout, ranks, tensors, rows, tmp)
                tp = "–"
                if layout == "fsdp":
                    with tempfile.TemporaryDirectory() as tmp:
                        *_, t_tp, read_tp, _ = _tabled(layout, ranks, tensors, rows, tmp, to_tp=True)
                    tp = f"{t_tp:.2f} ({read_tp})"
                print(f"| {layout} | {ranks} | {tensors} | {dt:.3f} | {received} | {trow} | "
                      f"{trow * ranks / 1e6:.1f} | {index / 1e6:.1f} | {table / 1e3:.0f} | {t_load:.2f} | {read} | "
                      f"{tp} | {loading} |", flush=True)
    if "fsdp" in layouts:
        _incremental_table(sizes, counts, rows)
    if "pp16" in layouts:
        print()
        print("Pipeline stages (pp16: 16 stages, each holding a sixteenth of the tensors, Shard(0) over its ranks, "
              "and a plain step count per tensor): rank 0 merges the first rank of each stage's description; one "
              "rank numbers the classes, scopes every stage's layouts and plans its writes:")
        print("| ranks | tensors | rank 0 merges (s) | rank 0 receives (kB) | plan, one rank (s) | "
              "received to plan, one rank (kB) |")
        print("|---|---|---|---|---|---|")
        for ranks in sizes:
            for tensors in counts:
                t_merge, to_zero, dt, received = _stages(ranks, tensors, rows)
                print(f"| {ranks} | {tensors} | {t_merge:.3f} | {to_zero / 1e3:.0f} | {dt:.3f} | "
                      f"{received / 1e3:.0f} |", flush=True)
    if "pairs" in layouts:
        print()
        print("Hand-made shards (pairs): their layouts inferred on rank 0 from the boxes of the probes (rank 0 and "
              "every divisor of the world), then checked by every rank against its own box:")
        print("| ranks | tensors | probes | infer on rank 0 (s) | rank 0 receives for it (kB) |")
        print("|---|---|---|---|---|")
        for ranks in sizes:
            for tensors in counts:
                dt, received, probes = _inference(ranks, tensors, rows)
                print(f"| {ranks} | {tensors} | {probes} | {dt:.3f} | {received / 1e3:.1f} |", flush=True)


def _windows_table(sizes: list[int], counts: list[int], rows: int, chunks: int) -> None:
    import tempfile

    print()
    print("The tools' reads of every chunk record (`diff`, the exports; fsdp), all tables at once vs by windows of "
          f"consecutive keys of about {chunks} records (`Reader.read_order`):")
    print("| ranks | tensors | chunk records | all at once: s, peak RSS growth MB | by windows: s, peak RSS growth MB "
          "| windows |")
    print("|---|---|---|---|---|---|")
    for ranks in sizes:
        for tensors in counts:
            got: dict[str, float] = {"chunks": chunks}
            with tempfile.TemporaryDirectory() as tmp:
                _tabled("fsdp", ranks, tensors, rows, tmp, windows=got)
            print(f"| {ranks} | {tensors} | {ranks * tensors} | {got['all_s']:.1f}, {got['all_peak'] / 1e6:.0f} | "
                  f"{got['win_s']:.1f}, {got['win_peak'] / 1e6:.0f} | {got['windows']:.0f} |", flush=True)


def _incremental_table(sizes: list[int], counts: list[int], rows: int) -> None:
    import tempfile

    print()
    print("Incremental saves on such a checkpoint (fsdp): rank 0 decodes the base's index, broadcasts its "
          "tensors and sends each rank its own table's reference and files; one rank reads its own table of the "
          "base (`core.base`):")
    print("| ranks | tensors | rank 0: decode + split (s) | of which split (s) | received, one rank (kB) | one "
          "rank reads its table (s) | base chunks it may reference | index grows per rank (B) |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in sizes:
        for tensors in counts:
            got: dict[str, float] = {}
            with tempfile.TemporaryDirectory() as tmp:
                _tabled("fsdp", ranks, tensors, rows, tmp, incremental=got)
            print(f"| {ranks} | {tensors} | {got['zero_s']:.2f} | {got['split_s']:.2f} | {got['received'] / 1e3:.1f} | "
                  f"{got['rank_s']:.3f} | {got['chunks']:.0f} | {got['per_rank_index']:.0f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="256,1024,4096")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--layouts", default="fsdp,fsdp×tp8,pairs,ddp")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--own-ranks", default="1024,16384,100000",
                    help="rank counts for the table of plans each rank makes on its own")
    ap.add_argument("--own-tensors", default="100,1000")
    ap.add_argument("--skip-gathered", action="store_true", help="only the table of plans made on their own")
    ap.add_argument("--windows", type=int, default=0, metavar="CHUNKS",
                    help="only the table of the tools' reads of every chunk record, by windows of CHUNKS records "
                         "(--own-ranks, --own-tensors)")
    ap.add_argument("--incremental-only", action="store_true",
                    help="only the table of incremental saves on a base with chunk tables (--own-ranks, --own-tensors)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    print(f"# {datetime.date.today()} {machine()}")
    print(f"# {args.tensors} tensors of max({args.rows}, ranks) × {COLS} fp32; one process; median of {args.reps}")
    own = ([int(x) for x in args.own_ranks.split(",")], [int(x) for x in args.own_tensors.split(",")])
    if args.incremental_only:
        _incremental_table(*own, args.rows)
        return 0
    if args.windows:
        _windows_table(*own, args.rows, args.windows)
        return 0
    if args.skip_gathered:
        _own_table(*own, args.layouts.split(","), args.rows)
        return 0
    print("| layout | ranks | liferaft plan_save (s) | one rank's metadata (kB) | received per rank (MB) | "
          "manifest (MB) | index with explicit boxes (MB) | liferaft load plan, 1 rank: → ¾ ranks / → FSDP × TP 8 "
          "(s) | DCP global save plan (s) | DCP metadata (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        last: tuple[int, float] | None = None
        for ranks in sizes:
            if last is not None and last[1] * (ranks / last[0]) ** 2 > args.budget_s:
                print(f"| {layout} | {ranks} | skipped (est. {last[1] * (ranks / last[0]) ** 2:.0f} s) |||||||")
                continue
            metas = _metas(layout, ranks, args.tensors, args.rows)
            one = len(pickle.dumps(metas[0]))
            times, plan = [], None
            for _ in range(args.reps):
                dt, plan = _liferaft_save(metas)
                times.append(dt)
            t_save = statistics.median(times)
            last = (ranks, t_save)
            man, boxed = _manifest_bytes(plan), _boxes_index_bytes(plan)
            t_load = (f"{_liferaft_load(plan, ranks, args.rows, args.tensors):.3f} / "
                      f"{_liferaft_load(plan, ranks, args.rows, args.tensors, to_tp=True):.3f}"
                      if layout == "fsdp" else "–")
            dplans = _dcp_plans(layout, ranks, args.tensors, args.rows)
            d_times, metadata = [], None
            for _ in range(args.reps):
                dt, metadata = _dcp_save(dplans)
                d_times.append(dt)
            print(f"| {layout} | {ranks} | {t_save:.2f} | {one / 1e3:.1f} | {one * ranks / 1e6:.1f} | "
                  f"{man / 1e6:.1f} | {boxed / 1e6:.1f} | {t_load} | {statistics.median(d_times):.2f} | "
                  f"{len(pickle.dumps(metadata)) / 1e6:.1f} |", flush=True)
            del metas, plan, dplans, metadata
    _own_table(*own, args.layouts.split(","), args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
