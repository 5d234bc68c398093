"""The one load pipeline, for every format: open → plan → read → apply.

Whatever the checkpoint's format (liferaft, DCP, safetensors, ``torch.save``: a :class:`formats.base.Reader`), the
same checks run on every rank before any byte is copied — keys (strict / missing / unexpected, stateful objects
that refuse what they would load, optional subtrees, buffers not persisted), kinds, shapes, dtypes, per-rank values
against the world size, lossy entries against ``exact``, data files present and long enough — then the same reads
into the live tensors (liferaft's verified, coalesced and shared between ranks: over the process group on remote
storage, through shared memory between the ranks of a host on local files, see ``core.chunks.shm``), then one
assignment into the state and ``load_state_dict`` of its stateful objects. Every step that can fail on one rank is
followed by an exchange, so every rank raises when any rank fails and nothing hangs (collectives time out).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from liferaft.codecs.checksum import digest
from liferaft.core.aliasing import check_disjoint, check_tied, check_writable
from liferaft.core.chunks import shm
from liferaft.core.native import NativeReader
from liferaft.core.open import open_reader
from liferaft.core.process import in_call
from liferaft.dist import Coordinator
from liferaft.errors import (
    CorruptCheckpointError,
    DistributedError,
    InvalidStateError,
    LossyCheckpointError,
    OptionsError,
    StateMismatchError,
)
from liferaft.formats.base import Box, BoxRead, Reader, TensorSpec
from liferaft.formats.detect import NAMES
from liferaft.options import LoadOptions, LoadResult, check_options, check_path
from liferaft.planning.share_plan import MIN_SHARED_BYTES, plan_sharing
from liferaft.staging.pool import PAGE
from liferaft.state.dtypes import torch_dtype
from liferaft.state.flatten import FlatState, PathPart, flatten, key_of
from liferaft.state.matching import (
    covers,
    drop_absent,
    matches_emptied,
    not_persisted,
    param_groups_malformed,
    param_groups_mismatch,
    param_groups_regrouped,
    settle_missing,
    value_within,
)
from liferaft.state.values import PerRank, as_leaf, per_rank_leaf
from liferaft.storage import Storage

__all__ = ["load", "load_held"]

PathLike = str | os.PathLike[str]


@in_call
def load(path: PathLike | Storage, state: Any, *, process_group: Any = None, strict: bool = True,
         options: LoadOptions | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place, in the layout ``state`` has now.

    ``path`` is a liferaft checkpoint (a folder, a URL, a storage backend), a PyTorch DCP folder, a safetensors
    file or Hugging Face folder, or a ``torch.save`` file (read with ``weights_only=True``): one pipeline for all.
    Tensors, DTensors and ``Sharded`` shards are filled in place from whichever saved chunks overlap them (only
    those byte ranges are read; liferaft's bytes are verified against their checksums, the other formats carry
    none); plain values are replaced in their containers; stateful objects get ``load_state_dict`` with the
    loaded values. With ``strict`` (default) a key missing from the checkpoint or present in it but absent from
    every rank's state raises StateMismatchError before anything is changed; otherwise they are listed in the
    result. Shape/dtype mismatches always raise. Every check that needs no data (keys, shapes, dtypes, files
    present and long enough, format version, paths) runs on every rank before any byte is copied;
    ``LoadOptions(atomic=True)`` extends that to the checksums.
    """
    check_path(path, "load(path=...)")
    opts = check_options(options, LoadOptions, "load")
    t_start = time.perf_counter()
    coord = Coordinator(process_group, opts.timeout)
    reader = open_reader(path, opts, coord=coord)
    try:
        return _load(reader, state, coord, opts, strict, t_start)
    finally:
        reader.close()


@in_call
def load_held(storage: Storage, state: Any, *, holders: Mapping[str, Sequence[int]], process_group: Any = None,
              strict: bool = True, options: LoadOptions | None = None) -> LoadResult:
    """``load`` of a liferaft checkpoint whose data files are not all readable by every rank: ``holders`` names,
    for each data file, the ranks that can read it (a memory tier's node-local copies; a file not named: every
    rank). A rank reads what it holds from ``storage``; each byte range it needs from a file it cannot read is
    read by a holder and sent to it (``planning.share_plan``: only the ranges its load plan needs, through a
    bounded staging buffer), and verified against the manifest's checksums on receipt like any read. Every
    rank must hold the commit (``COMMIT`` and the manifest) in its ``storage``; any layout and world size."""
    opts = check_options(options, LoadOptions, "load")
    t_start = time.perf_counter()
    coord = Coordinator(process_group, opts.timeout)
    reader = open_reader(storage, opts, coord=coord)
    try:
        if not isinstance(reader, NativeReader):
            raise InvalidStateError(f"{reader.url}: load_held reads liferaft checkpoints only (found "
                                    f"{NAMES[reader.fmt]}); load it with liferaft.load")
        reader.held_elsewhere(f for f, ranks in holders.items() if coord.rank not in ranks)
        return _load(reader, state, coord, opts, strict, t_start, dict(holders))
    finally:
        reader.close()


def _load(reader: Reader, state: Any, coord: Coordinator, opts: LoadOptions, strict: bool,
          t_start: float, holders: dict[str, Sequence[int]] | None = None) -> LoadResult:
    timings: dict[str, float] = {}
    plans: list[_LoadPlan] = []
    mode = "peers" if holders is not None else _share_mode(reader, coord, opts)
    all_keys = reader.keys
    width = len(all_keys) + 8
    # what steers the load's collective steps must be the same on every rank (strict=(rank == 0) raised on one
    # rank after planning and left the others in the next collective, crossing the next call's messages)
    # (ignore_keys as a set: the same keys in another order are the same option; share_reads may differ, the
    # sharing mode's own vote settles it)
    if isinstance(reader, NativeReader):
        opts = reader.options       # (max_read_bytes resolved: where None, the size the ranks agreed on, core.open)
    agreed = zlib.crc32(repr((strict, opts.allow_pickle, opts.exact, opts.atomic, opts.max_read_bytes,
                              sorted(set(opts.ignore_keys)))).encode()) & 0x7FFF_FFFF
    mine: list[Any] = []        # this rank's spans and decoded sizes, and its host key (mode "host")

    def planned() -> tuple[None, list[int]]:
        plans.append(_plan_load(reader, flatten(state, template=True, world=coord.world), coord, opts, strict))
        p = plans[0]
        spans = p.job.spans if mode and holders is None else \
            [(u.file, u.file_offset, u.length) for u, _ in p.job.units] if mode else []
        hosted: Any = None
        if mode == "peers" and holders is None:     # one message per span: only spans worth one
            spans = [s for s in spans if max(s[2], p.job.span_bytes[s]) >= MIN_SHARED_BYTES]
        if mode == "host":
            spans = [s for s in spans if p.job.span_bytes.get(s, opts.max_read_bytes + 1) <= opts.max_read_bytes]
            hosted = (shm.host_key(), {s: p.job.span_bytes[s] for s in spans if p.job.span_bytes[s] > s[2]})
            shm.sweep_stale()
        mine.append((spans, hosted))
        code = _MODES.index(mode)
        hid = _host_id(hosted[0]) if hosted is not None else 0
        # (one all-reduce: which keys some rank loads, whether every rank chose the same way of sharing, whether
        # any rank misses or skips keys, whether every rank is on one host: what a rank receives does not grow
        # with the world)
        return None, [*p.covered, code, -code, int(bool(p.missing)), int(bool(p.skipped)), agreed, -agreed,
                      hid, -hid]
    _, voted = coord.run_max(planned, width, "load (planning)")
    n = len(all_keys)
    if voted[n + 4] != -voted[n + 5]:
        raise OptionsError("load: the ranks called it with different strict= or LoadOptions (allow_pickle, exact, "
                           "atomic, max_read_bytes, ignore_keys; max_read_bytes=None is the smallest read_size of "
                           "the ranks' storages, at most 8 MiB on several ranks from local storage); nothing was "
                           "loaded. Pass the same arguments on every rank")
    if voted[n] != -voted[n + 1]:           # (a rank without /dev/shm): no rank shares, all alike
        mode = None
    plan = plans[0]
    unexpected = tuple(k for k, hit in zip(all_keys, voted[:n]) if not hit)
    missing: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    if voted[n + 2] or voted[n + 3]:        # (rare: the lists, from the ranks that have some)
        lists = coord.exchange((plan.missing, plan.skipped), None, "load (planning)")
        missing = tuple(sorted({k for m, _ in lists for k in m}))
        skipped = tuple(sorted({k for _, s in lists for k in s}))
    shares = False                  # (mode "host": whether the ranks of any host share, the same on every rank)
    if mode == "host":
        # (every rank on one host, as the vote's largest and smallest host ids say: they are the host's ranks, and
        # every rank plans the host's sharing from the same spans, so each knows whether any rank shares)
        one_host = voted[n + 6] == -voted[n + 7]
        mates = tuple(range(coord.world)) if one_host else \
            coord.peers_alike(_host_id(mine[0][1][0]), "load (planning)")     # (the ranks of this host)
        spans_of = _mates_spans(coord, mates, mine[0])
        sharing = _host_sharing(spans_of, mates, coord.world, opts)
        shares = bool(sharing) if one_host else bool(coord.all_max([int(bool(sharing))], "load (planning)")[0])
    elif mode and holders is None:
        # (spans shared over the process group, within a host: a span another host needs too is read there as
        # well, which costs its network what sending it would; what a rank receives grows with its host's ranks)
        spans_of = _mates_spans(coord, coord.peers_alike(_host_id(shm.host_key()), "load (planning)"), mine[0])
        sharing = plan_sharing([spans_of[r][0] if r in spans_of else [] for r in range(coord.world)], min_bytes=0)
    elif mode:              # (a memory tier's node-local files: every rank's spans, the holders read for others)
        every = coord.exchange(mine[0][0], None, "load (planning)")
        sharing = {} if coord.world == 1 else plan_sharing(every, holders=holders)
    else:
        sharing = {}
    refused = tuple(k for k in unexpected if not opts.ignores(k))
    if strict and (missing or refused):
        raise StateMismatchError(_mismatch_message(reader.url, NAMES[reader.fmt] if reader.fmt != "liferaft"
                                                   else "checkpoint", missing, refused))
    host = _set_up_host(coord, sharing, plan.job.span_bytes, opts) if shares else None   # (collective)
    if isinstance(host, str):
        if opts.share_reads:        # (asked for; by default a host without room just reads as before)
            warnings.warn(f"{reader.url}: shared reads are off for this load, each rank reads for itself: "
                          f"{host}", stacklevel=3)
        host, sharing = None, {}
    peers = coord if sharing else None
    timings["plan"] = time.perf_counter() - t_start

    try:
        t0 = time.perf_counter()
        if opts.atomic and reader.verified:
            coord.run(lambda: plan.job.run(check_only=True, peers=peers, rank=coord.rank, sharing=sharing,
                                           host=host) and None, "load (verify)")
            timings["verify"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        stats = coord.run(lambda: plan.job.run(peers=peers, rank=coord.rank, sharing=sharing, host=host),
                          "load (read)")[coord.rank]
    finally:
        if host is not None:
            host.close(background=True)
    timings["read"] = time.perf_counter() - t0
    timings["checksum"] = stats.verify_s        # part of "read" (overlapped with the I/O): the cost of verifying

    t0 = time.perf_counter()
    coord.run(plan.apply, "load (apply)")
    timings["apply"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    if plan.lossy:
        shown = "; ".join(f"{k}: {_describe_lossy(v)}" for k, v in list(plan.lossy.items())[:5])
        more = f" and {len(plan.lossy) - 5} more" if len(plan.lossy) > 5 else ""
        warnings.warn(f"{reader.url}: {len(plan.lossy)} loaded tensor(s) were stored lossily: {shown}{more}",
                      stacklevel=3)
    return LoadResult(path=reader.url, rank=coord.rank, bytes_read=stats.used, bytes_received=stats.received,
                      missing_keys=missing, unexpected_keys=unexpected, timings=timings, lossy=plan.lossy,
                      skipped_keys=skipped, tables_read=getattr(reader, "tables_read", None))


def _share_mode(reader: Reader, coord: Coordinator, opts: LoadOptions) -> str | None:
    """How spans several ranks need are shared (``LoadOptions.share_reads``): "peers" (read by one rank, sent
    over the process group: remote storage, or local files without shared memory when asked for), "host"
    (read and verified by one rank of the host into shared memory, ``core.chunks.shm``: local files, ranks of
    one host only; also by default), or None (each rank reads for itself). Ranks that chose differently (one
    without a shared-memory folder) share nothing (``_load``, after the planning exchange)."""
    if not reader.verified or coord.world == 1 or opts.share_reads is False:
        return None
    if getattr(getattr(reader, "storage", None), "remote", False):
        return "peers"
    if shm.available():
        return "host"
    return "peers" if opts.share_reads else None    # (over loopback: measured slower than each rank reading)


def _mates_spans(coord: Coordinator, host: Sequence[int], mine: tuple[Any, Any]) -> dict[int, Any]:
    """The spans and decoded sizes (``mine``: this rank's) of this rank and of the other ranks of its ``host``
    (the ranks of this host), exchanged among those ranks only (``Coordinator.swap_among``): what a rank receives
    grows with its host's ranks and their reads, not with the job's (collective over each host's ranks)."""
    return coord.swap_among(host, mine, (SPAN_SIZE_TAG, SPAN_TAG), "load (planning: the spans of this host's ranks)")


#: how a load shares its reads (``_share_mode``), as the number each rank votes with
_MODES = (None, "peers", "host")


def _host_id(key: str) -> int:
    """A rank's host (``shm.host_key``) as a 62-bit number: what the ranks all-gather to find their host's ranks."""
    return int(digest(key.encode()), 16) >> 2


#: the tags of the exchange of read spans among a host's ranks (``_mates_spans``; ``dist.GATHER_TAG`` is
#: 0x4C46_0001, the tags of shared spans count up from 0)
SPAN_SIZE_TAG, SPAN_TAG = 0x4C46_0002, 0x4C46_0003


def _host_sharing(spans_of: Mapping[int, Any], mates: Sequence[int], world: int, opts: LoadOptions) -> Any:
    """The sharing plan of the ranks ``mates`` of one host (``spans_of``: their spans and decoded sizes by rank;
    ``world`` ranks in all): their spans, runs up to ``max_read_bytes``, short spans when linked to long ones."""
    return plan_sharing([spans_of[r][0] if r in spans_of else [] for r in range(world)],
                        min_bytes=min(MIN_SHARED_BYTES, opts.max_read_bytes // 4),
                        run_bytes=opts.max_read_bytes,          # a reader's runs: one read per slot
                        decoded={s: n for r in mates for s, n in spans_of[r][1][1].items()})


def _set_up_host(coord: Coordinator, sharing: Any, span_bytes: Mapping[Any, int],
                 opts: LoadOptions) -> shm.HostShare | str:
    """Collective: the segments of a load whose ranks share through the host's memory (``sharing``, among ranks
    of one host). A rank that reads shared spans makes its own, slots sized to what it reads (at most
    ``max_read_bytes``, the longest read; ``span_bytes``: each span's bytes once decoded), and a rank that reads
    none makes none, so a load that shares a few small spans reserves little (the first slot here, the others
    while the first is read: ``HostReads``); the ranks exchange (name, slot
    size, slots), each opens (read-only) the segments of the ranks it receives from, and once every rank has,
    each unlinks its own name, so that the segments live only in the ranks' mappings from here on. Returns the
    ``HostShare``, or, when some rank cannot make its segment (``SegmentError``: no room, refused) or open a
    peer's (not this host's shared-memory folder after all), why: then no rank has a segment and no rank shares
    (decided alike on every rank)."""
    mine = [s for s, shared in sharing.items() if shared.reader == coord.rank]
    need = min(opts.max_read_bytes, sum(max(s[2], span_bytes.get(s, 0)) + 2 * PAGE for s in mine))
    own: list[shm.Segment] = []

    def make() -> tuple[str, int, int, str]:
        if not mine:
            return "", 0, 0, ""
        try:
            own.append(shm.Segment.create(shm.new_name(coord.rank), shm.slot_size(need), shm.SLOTS, reserve=1))
        except shm.SegmentError as e:
            return "", 0, 0, str(e)
        return own[0].name, own[0].slot_bytes, own[0].slots, ""
    made = coord.run(make, "load (shared-memory set-up)", cleanup=lambda: [g.close() for g in own])
    short = [r for r, m in enumerate(made) if m[3]]
    if short:
        for g in own:
            g.close()
        return f"rank {short[0]}: {made[short[0]][3]}"
    share = shm.HostShare(own[0] if own else None, {})
    if not any(m[0] for m in made):
        return share                # nothing shared on any host (the same on every rank): nothing to open
    sources = sorted({s.reader for s in sharing.values() if coord.rank in s.receivers})

    def attach() -> str:
        try:
            for r in sources:
                share.peers[r] = shm.Segment.attach(made[r][0], made[r][1], made[r][2], r)
        except (DistributedError, OSError) as e:     # (not this host's folder after all, say)
            return f"rank {coord.rank}: {e}"
        return ""
    try:
        opened = coord.run(attach, "load (shared-memory attach)", cleanup=share.close)
    except BaseException:
        for r in sources:           # the names of peers of this host that died before unlinking theirs
            shm.unlink(made[r][0])
        raise
    if own:
        shm.unlink(own[0].name)
    refused = [why for why in opened if why]
    if refused:                     # every rank saw the same answers: no rank shares
        share.close()
        return refused[0]
    return share


def _describe_lossy(how: Any) -> str:
    if how.get("method") == "q8-block":
        return (f"8-bit block quantization, max abs error {how.get('max_abs_error', float('nan')):.3g}, mean "
                f"{how.get('mean_abs_error', float('nan')):.3g}")
    if how.get("method") == "selective":
        return (f"{how.get('chunks')} of {how.get('of_chunks')} chunk(s) not saved at this step but taken from "
                f"{', '.join(how.get('from') or [])} (relative change up to {how.get('max_change', 0):.3g})")
    return str(how)


def _mismatch_message(url: str, what: str, missing: tuple[str, ...], unexpected: tuple[str, ...]) -> str:
    parts = [f"{url}: the state does not match the {what} (nothing was loaded)."]
    if missing:
        parts.append(f"Missing from the checkpoint: {', '.join(repr(k) for k in missing[:10])}"
                     + (f" and {len(missing) - 10} more" if len(missing) > 10 else "") + ".")
    if unexpected:
        parts.append(f"In the checkpoint but not in the state: {', '.join(repr(k) for k in unexpected[:10])}"
                     + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else "") + ".")
    parts.append("Pass strict=False to load the keys that match and list the others in the result.")
    return " ".join(parts)


class _LoadPlan:
    """One rank's load: reads into targets, then values to assign and stateful objects to update."""

    def __init__(self, flat: FlatState, reader: Reader, strict: bool) -> None:
        self.flat, self.reader, self.strict = flat, reader, strict
        self.requests: list[BoxRead] = []
        self.job: Any = None
        self.assign: list[tuple[tuple[PathPart, ...], Any]] = []
        #: tensors read whole, then converted to what the state holds there: (path, kind, tensor read into)
        self.fresh: list[tuple[tuple[PathPart, ...], str, torch.Tensor]] = []
        #: per-rank tensors loaded whole on another world size: (path, spec, tensor read into, saving world size)
        self.fresh_per_rank: list[tuple[tuple[PathPart, ...], TensorSpec, torch.Tensor, int]] = []
        self.covered = bytearray()     # one byte per reader key (tensors, then values): 1 = this rank loads it
        self.missing: list[str] = []
        self.absent: list[tuple[PathPart, ...]] = []   # optional subtrees the checkpoint lacks (state.matching)
        self.skipped: list[str] = []                   # checkpoint keys the state does not persist
        self.lossy: dict[str, dict[str, Any]] = {}
        self.inner: dict[str, list[tuple[PathPart, ...]]] = {}     # saved value key -> the paths taken out of it
        self.saved_value = functools.cache(reader.value)            # (decoded once however many paths it serves)

    def want(self, spec: TensorSpec, boxes: list[tuple[Box, torch.Tensor]]) -> None:
        self.requests.extend((spec.key, box, local) for box, local in boxes)

    def want_whole(self, spec: TensorSpec) -> torch.Tensor:
        target = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
        self.want(spec, [((tuple(0 for _ in spec.shape), spec.shape), target)])
        return target

    def apply(self) -> None:
        for path, kind, target in self.fresh:
            self.assign.append((path, as_leaf(kind, target)))
        for path, spec, target, world in self.fresh_per_rank:
            self.assign.append((path, per_rank_leaf(spec.kind, spec.per_rank or (), target, world)))
        with torch.no_grad():
            for path, value in self.assign:
                _assign(self.flat, path, value)
        drop_absent(self.flat, self.absent)
        for _, adapter, sd in reversed(self.flat.statefuls):
            adapter.load_state_dict(sd)


def _plan_load(reader: Reader, flat: FlatState, coord: Coordinator, opts: LoadOptions,
               strict: bool = True) -> _LoadPlan:
    plan = _LoadPlan(flat, reader, strict)
    tensors, values = reader.tensors, reader.values
    index = {k: i for i, k in enumerate(reader.keys)}
    plan.covered = bytearray(len(index))
    for leaf in flat.tensors:
        spec = tensors.get(leaf.key)
        if leaf.kind != "tensor":                       # numpy arrays and bytes: new values, not filled in place
            _plan_value(plan, leaf.key, leaf.path, index, coord, opts, leaf.kind)
            continue
        if spec is None:
            if leaf.key in values:
                raise StateMismatchError(f"key {leaf.key!r} is a plain value in the checkpoint but a tensor in the "
                                         "state")
            plan.missing.append(leaf.key)
            continue
        if spec.kind != "tensor" or spec.dtype != leaf.dtype_name or spec.held_shape != leaf.shape:
            raise StateMismatchError(
                f"key {leaf.key!r}: the checkpoint holds {spec.kind} {list(spec.held_shape)} {spec.dtype}"
                f"{' per rank' if spec.per_rank is not None else ''} but the state holds {list(leaf.shape)} "
                f"{leaf.dtype_name}; nothing was loaded")
        for _, local in leaf.parts:
            check_writable(leaf.key, local)
        plan.covered[index[leaf.key]] = 1
        if spec.lossy is not None:
            if opts.exact:
                raise LossyCheckpointError(
                    f"key {leaf.key!r} is stored lossily in the checkpoint ({_describe_lossy(spec.lossy)}) and the "
                    "load asked for an exact resume (LoadOptions(exact=True)); nothing was loaded. Load an exact "
                    "checkpoint, or load without exact=True to accept the recorded error")
            plan.lossy[leaf.key] = dict(spec.lossy)
        if spec.per_rank is None:
            plan.want(spec, leaf.parts)
            continue
        full = (tuple(0 for _ in leaf.shape), leaf.shape)
        if any(box != full for box, _ in leaf.parts):
            raise StateMismatchError(f"key {leaf.key!r} was saved per rank (its copies differed between the "
                                     "ranks), but the state holds a shard of it; nothing was loaded")
        row = _per_rank_row(plan, leaf.key, leaf.path, spec, coord)
        if row is None:
            continue
        if row >= 0:
            plan.want(spec, [(((row,) + full[0], (1,) + full[1]), local.unsqueeze(0)) for _, local in leaf.parts])
        else:
            plan.fresh_per_rank.append((leaf.path, spec, plan.want_whole(spec), reader.world_size or coord.world))
    dests = {(leaf.key, i): (box[0], local) for leaf in flat.tensors if leaf.kind == "tensor" and leaf.key in tensors
             for i, (box, local) in enumerate(leaf.parts)}
    check_tied(reader, check_disjoint((k, i, local) for (k, i), (_, local) in dests.items()), dests)
    for key, path, _ in flat.values:
        _plan_value(plan, key, path, index, coord, opts)
    for outer, taken in plan.inner.items():             # (a saved value the state took only part of: unexpected)
        plan.covered[index[outer]] = int(covers(plan.saved_value(outer), taken))
    _check_statefuls(plan, index, coord, strict)
    plan.missing, plan.absent = settle_missing(flat, plan.missing, reader.classes, index)
    for k in reader.values if plan.absent else ():
        spec = values[k]
        if not plan.covered[index[k]] and spec.path in flat.nodes and not spec.per_rank and \
                matches_emptied(flat, plan.absent, spec.path, reader.value(k)):
            plan.covered[index[k]] = 1
    plan.skipped = not_persisted(flat, (k for k, i in index.items() if not plan.covered[i]))
    for k in plan.skipped:
        plan.covered[index[k]] = 1
    plan.job = reader.plan(plan.requests)           # files present and long enough: checked here
    return plan


def _plan_value(plan: _LoadPlan, key: str, path: tuple, index: dict[str, int], coord: Coordinator,
                opts: LoadOptions, kind: str | None = None) -> None:
    """A leaf of the state that is replaced, not filled: a plain value, or (``kind``) a numpy array or bytes."""
    reader = plan.reader
    spec = reader.tensors.get(key)
    if key in reader.values:
        value = reader.value(key)
        if isinstance(value, PerRank):
            if len(value) != coord.world and _accepts_per_rank(plan.flat, path):
                plan.assign.append((path, value))       # the object maps the saved ranks' values itself
                plan.covered[index[key]] = 1
                return
            if len(value) != coord.world and not plan.strict:     # left as it is, listed as missing
                plan.covered[index[key]] = 1
                plan.missing.append(key)
                return
            if len(value) != coord.world:
                raise StateMismatchError(_resize_message(plan.flat, key, path, len(value), coord.world))
            if value.held is not None and coord.rank not in value.held:     # this rank held no such key
                plan.covered[index[key]] = 1
                plan.missing.append(key)
                return
            value = value[coord.rank]
        plan.assign.append((path, value))
    elif spec is not None and (spec.kind in ("numpy", "bytes") or kind is not None):
        as_kind = spec.kind if spec.kind != "tensor" else (kind or "tensor")
        if spec.per_rank is None:
            plan.fresh.append((path, as_kind, plan.want_whole(spec)))
        else:
            row = _per_rank_row(plan, key, path, spec, coord)
            if row is None:
                return
            if row >= 0:
                shape = spec.held_shape
                target = torch.empty(shape, dtype=torch_dtype(spec.dtype))
                plan.want(spec, [(((row,) + tuple(0 for _ in shape), (1,) + shape), target.unsqueeze(0))])
                plan.fresh.append((path, as_kind, target))
            else:
                plan.fresh_per_rank.append((path, spec, plan.want_whole(spec), reader.world_size or coord.world))
    elif spec is not None:
        raise StateMismatchError(f"key {key!r} is a tensor in the checkpoint but a plain value in the state; "
                                 f"put a tensor of shape {list(spec.shape)} there")
    elif parts := reader.value_parts(key):              # a nested value the format split into several keys
        plan.assign.append((path, reader.joined_value(key, parts)))
        for p in parts:
            plan.covered[index[p]] = 1
    elif (inside := value_within(lambda k: k in reader.values and not opts.ignores(k), plan.saved_value,
                                 path)) is not None:
        outer, depth, value = inside                    # (inside a plain value saved whole: covered once all taken)
        plan.assign.append((path, value))
        plan.inner.setdefault(outer, []).append(path[depth:])
        return
    else:
        plan.missing.append(key)
        return
    plan.covered[index[key] if key in index else index[parts[0]]] = 1


def _check_statefuls(plan: _LoadPlan, index: dict[str, int], coord: Coordinator, strict: bool) -> None:
    """Stateful objects that refuse what they would load, and optimizers whose saved param_groups are of another
    kind (``state.matching``), before any byte moves."""
    flat = plan.flat
    for spath, adapter, _ in flat.statefuls:
        check: Callable[..., Any] | None = getattr(adapter, "check_load", None)
        if check is not None:
            check({p[len(spath):]: v for p, v in plan.assign if p[:len(spath)] == spath}, coord.world,
                  f"key {key_of(spath)!r}")
    kept = []
    for path, value in plan.assign:
        damaged = param_groups_malformed(flat, path, value)
        if damaged is not None:
            raise CorruptCheckpointError(f"{plan.reader.url}: {damaged}: the checkpoint is damaged; nothing was "
                                         "loaded. Restore from another checkpoint")
        problem = param_groups_mismatch(flat, path, value)
        regrouped = param_groups_regrouped(flat, path, value) if problem is None else None
        if regrouped is not None and strict:
            raise StateMismatchError(f"{regrouped[0]}; nothing was loaded. Group the live optimizer's parameters "
                                     "as when it was saved, or pass strict=False: each live group a saved group "
                                     "matches takes its hyperparameters, the others keep their own")
        if regrouped is not None:               # (not strict: the groups matched loaded, the others kept)
            kept.append((path, regrouped[1]))
            plan.missing.append(key_of(path))
            continue
        if problem is None:
            kept.append((path, value))
            continue
        if strict:
            raise StateMismatchError(f"{problem}; nothing was loaded. Load it into the optimizer that saved it, "
                                     "or pass strict=False to keep the live optimizer's param_groups")
        key = key_of(path)
        if key in index:
            plan.covered[index[key]] = 0
        plan.missing.append(key)
    plan.assign = kept


def _per_rank_row(plan: _LoadPlan, key: str, path: tuple, spec: TensorSpec, coord: Coordinator) -> int | None:
    """Which row of a tensor stored per rank this rank loads: its own when the world size is the one that saved
    (None, and the key is missing, if this rank did not hold it then); -1: every row, as a ``PerRank`` for an
    object that maps the saved ranks itself (``accepts_per_rank``). Else the load is refused."""
    saved_world = plan.reader.world_size or coord.world
    ranks = spec.per_rank or ()
    if coord.world == saved_world:
        if coord.rank not in ranks:
            plan.missing.append(key)
            return None
        return ranks.index(coord.rank)
    if _accepts_per_rank(plan.flat, path):
        return -1
    if not plan.strict:                 # left as it is, listed as missing
        plan.missing.append(key)
        return None
    raise StateMismatchError(_resize_message(plan.flat, key, path, saved_world, coord.world))


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
