"""The one-process tools over a native checkpoint: read, inspect, verify."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from liferaft.core.chunks.blocks import read_blocks
from liferaft.core.chunks.dtypes import torch_dtype
from liferaft.core.chunks.reader import execute_reads
from liferaft.core.commit import check_files, open_checkpoint
from liferaft.errors import CorruptCheckpointError, LiferaftError, StateMismatchError
from liferaft.format.manifest import PathPart, TensorEntry, ValueEntry
from liferaft.options import LoadOptions
from liferaft.planning.load_plan import plan_reads
from liferaft.state.values import PerRank, decode_value
from liferaft.storage import Storage, resolve
from liferaft.storage.refs import with_references


def decode_entry_value(v: ValueEntry, allow_pickle: bool) -> Any:
    if v.per_rank is None:
        return decode_value(v.value, v.key, allow_pickle)
    return PerRank(decode_value(x, v.key, allow_pickle) for x in v.per_rank)


def as_leaf(entry: TensorEntry, t: torch.Tensor) -> Any:
    """Convert a loaded full tensor back to what was saved (tensor, numpy array or bytes)."""
    if entry.kind == "numpy":
        return t.numpy()
    if entry.kind == "bytes":
        return t.numpy().tobytes()
    return t


def copy_shape(entry: TensorEntry) -> tuple[int, ...]:
    """The shape of the tensor as each rank held it: the entry's shape, less the ranks' dimension of one stored
    per rank (docs/FORMAT.md §4.5)."""
    return entry.shape[1:] if entry.per_rank is not None else entry.shape


def per_rank_leaf(entry: TensorEntry, t: torch.Tensor, world: int) -> "PerRank":
    """A tensor stored per rank, read whole, as a ``PerRank`` of ``world`` items (None for a rank that did not
    hold it)."""
    rows = dict(zip(entry.per_rank, t.unbind(0)))
    plain = TensorEntry(key=entry.key, path=entry.path, kind=entry.kind, dtype=entry.dtype, shape=copy_shape(entry),
                        chunks=())
    return PerRank(as_leaf(plain, rows[r].clone()) if r in rows else None for r in range(world))


def read_full(storage: Storage, entries: Sequence[TensorEntry], max_read: int) -> list[torch.Tensor]:
    """Full tensors for ``entries``, read and verified."""
    targets = [torch.empty(e.shape, dtype=torch_dtype(e.dtype)) for e in entries]
    units = []
    for i, e in enumerate(entries):
        dt = targets[i].dtype
        units.extend((u, dt) for u in plan_reads(e, [(i, (tuple(0 for _ in e.shape), e.shape))], max_read))
    execute_reads(storage, units, targets, max_read=max_read)
    return targets


def _select(keys: Sequence[str] | None, all_keys: Iterable[str]) -> set[str]:
    all_keys = list(all_keys)
    if keys is None:
        return set(all_keys)
    chosen: set[str] = set()
    for k in keys:
        hit = {a for a in all_keys if a == k or a.startswith(k + ".")}
        if not hit:
            raise StateMismatchError(f"key {k!r} is not in the checkpoint (nor any key under it)")
        chosen |= hit
    return chosen


def read(path: str | os.PathLike[str], keys: Sequence[str] | None = None, *,
         options: LoadOptions | None = None) -> Any:
    """Read a checkpoint in one process, without a template: full tensors, in the saved nesting.

    ``keys`` limits the result to these keys or key prefixes (``"model"`` selects ``model.*``). Stateful
    objects come back as their state dicts; numpy arrays and bytes as such; a value that differed per
    saving rank as a :class:`PerRank` tuple.
    """
    opts = options or LoadOptions()
    storage = with_references(resolve(path))
    manifest = open_checkpoint(storage)
    chosen = _select(keys, [t.key for t in manifest.tensors] + [v.key for v in manifest.values])
    entries = [t for t in manifest.tensors if t.key in chosen]
    check_files(storage, manifest, (c.file for e in entries for c in e.chunks))
    tensors = read_full(storage, entries, opts.max_read_bytes)
    leaves: dict[tuple[PathPart, ...], Any] = {
        e.path: per_rank_leaf(e, t, manifest.world_size) if e.per_rank is not None else as_leaf(e, t)
        for e, t in zip(entries, tensors)}
    for v in manifest.values:
        if v.key in chosen:
            leaves[v.path] = decode_entry_value(v, opts.allow_pickle)
    kinds = {c.path: c.kind for c in manifest.containers}
    orders = {c.path: c.children for c in manifest.containers if c.children is not None}
    if keys is not None:  # keep only containers on the way to chosen leaves
        needed = {p[:i] for p in leaves for i in range(len(p))}
        kinds = {p: k for p, k in kinds.items() if p in needed}
    return build_tree(kinds, leaves, orders)


def build_tree(kinds: Mapping[tuple[PathPart, ...], str], leaves: Mapping[tuple[PathPart, ...], Any],
               orders: Mapping[tuple[PathPart, ...], Sequence[PathPart]] | None = None) -> Any:
    """Nested dict/list/tuple from container kinds and leaf values keyed by path, children in saved order."""
    children: dict[tuple[PathPart, ...], list[PathPart]] = {p: [] for p in kinds}
    for p in list(kinds) + list(leaves):
        if p:
            children.setdefault(p[:-1], []).append(p[-1])
    for p, order in (orders or {}).items():
        if p in children:
            present = set(children[p])
            rank = {k: i for i, k in enumerate(order)}
            children[p] = sorted(present, key=lambda k: (rank.get(k, len(rank)), str(k)))

    def node(p: tuple[PathPart, ...]) -> Any:
        if p in leaves:
            return leaves[p]
        kind = kinds.get(p, "dict")
        parts = children.get(p, [])
        if kind in ("list", "tuple"):
            items = [node(p + (k,)) for k in sorted(parts, key=lambda x: int(x))]
            return items if kind == "list" else tuple(items)
        return {k: node(p + (k,)) for k in parts}

    return node(())


@dataclass(frozen=True)
class TensorInfo:
    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of a committed checkpoint (from its manifest only)."""

    path: str
    format_version: int
    save_id: str
    world_size: int
    created_unix: float
    liferaft_version: str
    torch_version: str
    tensors: tuple[TensorInfo, ...]
    values: tuple[str, ...]
    files: Mapping[str, int]
    metadata: Mapping[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def __str__(self) -> str:
        lines = [f"checkpoint {self.path}: format v{self.format_version}, written by {self.world_size} rank(s), "
                 f"liferaft {self.liferaft_version}, torch {self.torch_version}",
                 f"{len(self.tensors)} tensors, {len(self.values)} values, {len(self.files)} data files, "
                 f"{self.total_bytes / 2**20:.1f} MiB"]
        for t in self.tensors:
            lines.append(f"  {t.key:<50} {t.dtype:<9} {str(list(t.shape)):<20} {t.chunks:>4} chunk(s) "
                         f"{t.nbytes / 2**20:10.3f} MiB")
        for v in self.values:
            lines.append(f"  {v:<50} value")
        return "\n".join(lines)


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Summary of the committed checkpoint at ``path``: keys, shapes, dtypes, chunks and bytes."""
    storage = resolve(path)
    m = open_checkpoint(storage)
    return CheckpointInfo(
        path=storage.url, format_version=m.version, save_id=m.save_id, world_size=m.world_size,
        created_unix=m.created_unix, liferaft_version=m.liferaft_version, torch_version=m.torch_version,
        tensors=tuple(TensorInfo(t.key, t.kind, t.dtype, t.shape, t.nbytes, len(t.chunks)) for t in m.tensors),
        values=tuple(v.key for v in m.values), files=dict(m.files), metadata=dict(m.extra))


@dataclass(frozen=True)
class VerifyReport:
    path: str
    chunks: int
    bytes_checked: int


def verify(path: str | os.PathLike[str], *, max_read_bytes: int = 32 << 20,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-hash every block of every chunk; raise CorruptCheckpointError listing every fault found. ``progress`` is
    called with the bytes of each read (for a progress bar)."""
    storage = with_references(resolve(path))
    m = open_checkpoint(storage)
    faults: list[str] = []
    for name, size in m.files.items():
        try:
            actual = storage.size(name)
        except FileNotFoundError:
            faults.append(f"data file {name!r} is missing")
            continue
        if actual != size:
            faults.append(f"data file {name!r} has {actual} bytes, the manifest says {size}")
    chunks = checked = 0
    for t in m.tensors:
        for c in t.chunks:
            chunks += 1
            per_read = max(1, max_read_bytes // c.block_size)
            for first in range(0, len(c.hashes), per_read):
                end = min(len(c.hashes), first + per_read)
                try:
                    got = len(read_blocks(storage, c, first, end, t.dtype, t.key))
                    checked += got
                    if progress is not None:
                        progress(got)
                except LiferaftError as e:
                    if "is missing" not in str(e):          # (missing files are reported above)
                        faults.append(str(e))
                    break
    if faults:
        shown = "\n  ".join(faults[:20])
        more = f"\n  ... and {len(faults) - 20} more" if len(faults) > 20 else ""
        raise CorruptCheckpointError(f"{storage.url}: verify found {len(faults)} fault(s):\n  {shown}{more}")
    return VerifyReport(path=storage.url, chunks=chunks, bytes_checked=checked)


