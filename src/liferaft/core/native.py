"""liferaft's own format as a :class:`formats.base.Reader`: the committed manifest (``core.commit.open_checkpoint``)
and chunk reads that are coalesced, shared between ranks on remote storage and verified block by block
(``core.chunks.reader``). The one reader whose bytes are ``verified``."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from liferaft.core.chunks.blocks import read_blocks
from liferaft.core.chunks.reader import execute_reads
from liferaft.core.commit import check_files
from liferaft.errors import LiferaftError
from liferaft.format.manifest import Manifest, TensorEntry, ValueEntry
from liferaft.formats.base import BoxRead, CheckReport, Reader, ReadJob, ReadOutcome, TensorSpec, ValueSpec
from liferaft.options import LoadOptions
from liferaft.planning.load_plan import plan_reads
from liferaft.planning.share_plan import MIN_SHARED_BYTES
from liferaft.state.dtypes import torch_dtype
from liferaft.state.tree import build_tree
from liferaft.state.values import PerRank, decode_value
from liferaft.storage import Storage


def decode_entry_value(v: ValueEntry, allow_pickle: bool) -> Any:
    """A manifest's plain value, decoded; a ``PerRank`` for one that differed between the saving ranks."""
    if v.per_rank is None:
        return decode_value(v.value, v.key, allow_pickle)
    return PerRank(decode_value(x, v.key, allow_pickle) for x in v.per_rank)


def _spec(e: TensorEntry) -> TensorSpec:
    return TensorSpec(key=e.key, dtype=e.dtype, shape=tuple(e.shape), kind=e.kind, path=tuple(e.path),
                      per_rank=e.per_rank, lossy=e.lossy, boxes=tuple((c.offsets, c.sizes) for c in e.chunks),
                      nbytes=e.nbytes)


class NativeReader(Reader):
    """A committed liferaft checkpoint in ``storage`` (with references to sibling checkpoints resolved), read
    through its verified ``manifest``."""

    def __init__(self, storage: Storage, manifest: Manifest, options: LoadOptions | None = None) -> None:
        self.storage, self.manifest = storage, manifest
        self.options = options or LoadOptions()
        self.entries = manifest.tensor_map()
        self._values = {v.key: v for v in manifest.values}
        m = manifest
        super().__init__(
            url=storage.url, fmt="liferaft", verified=True, world_size=m.world_size,
            tensors={e.key: _spec(e) for e in m.tensors},
            values={v.key: ValueSpec(key=v.key, path=tuple(v.path), per_rank=v.per_rank is not None)
                    for v in m.values},
            classes={c.path: c.cls for c in m.containers if c.kind == "stateful"},
            info={"format_version": m.version, "save_id": m.save_id, "created_unix": m.created_unix,
                  "liferaft_version": m.liferaft_version, "torch_version": m.torch_version,
                  "files": dict(m.files), "metadata": dict(m.extra),
                  "containers": [(c.path, c.kind, c.children, c.cls) for c in m.containers]})

    def value(self, key: str) -> Any:
        return decode_entry_value(self._values[key], self.options.allow_pickle)

    def plan(self, requests: Sequence[BoxRead]) -> ReadJob:
        return _NativeJob(self, requests)

    def copy_box(self, key: str, offsets: Sequence[int], out: torch.Tensor) -> int:
        return self.plan([(key, (tuple(offsets), tuple(out.shape)), out)]).run().used

    def tree(self, leaves: Mapping[str, Any]) -> Any:
        m = self.manifest
        paths = {e.key: e.path for e in [*m.tensors, *m.values]}
        by_path = {paths[k]: v for k, v in leaves.items()}
        kinds = {c.path: c.kind for c in m.containers}
        if len(leaves) < len(paths):            # only the containers on the way to the leaves asked for
            needed = {p[:i] for p in by_path for i in range(len(p))}
            kinds = {p: k for p, k in kinds.items() if p in needed}
        orders = {c.path: c.children for c in m.containers if c.children is not None}
        return build_tree(kinds, by_path, orders)

    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        """Every data file present with the size the manifest records, and every block of every chunk re-hashed
        (``max_read_bytes`` at a time)."""
        storage, m = self.storage, self.manifest
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
                per_read = max(1, self.options.max_read_bytes // c.block_size)
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
        return CheckReport(path=storage.url, fmt=self.fmt, units=chunks, checked_bytes=checked, bytes_read=checked,
                           faults=tuple(faults))


class _NativeJob(ReadJob):
    """The reads of a native load: per box, the planned byte ranges of the chunks it overlaps
    (``planning.load_plan.plan_reads``), their files checked present and long enough at once."""

    def __init__(self, reader: NativeReader, requests: Sequence[BoxRead]) -> None:
        super().__init__(reader, requests)
        self.native = reader
        self.targets: list[torch.Tensor] = []
        self.units: list[Any] = []
        files: set[str] = set()
        max_read = reader.options.max_read_bytes
        for key, box, dest in self.requests:
            self.targets.append(dest)
            units = plan_reads(reader.entries[key], [(len(self.targets) - 1, box)], max_read)
            self.units.extend((u, dest.dtype) for u in units)
            files.update(u.file for u in units)
        check_files(reader.storage, reader.manifest, files)
        self.spans = [(u.file, u.file_offset, u.length) for u, _ in self.units if u.length >= MIN_SHARED_BYTES]

    def run(self, *, check_only: bool = False, peers: Any = None, rank: int = 0,
            sharing: Mapping[Any, Any] | None = None) -> ReadOutcome:
        stats = execute_reads(self.native.storage, self.units, self.targets, copy=not check_only,
                              max_read=self.native.options.max_read_bytes, peers=peers, rank=rank,
                              sharing=sharing or {})
        return ReadOutcome(used=stats.used, received=stats.received, verify_s=stats.verify_s)


def read_full(storage: Storage, entries: Sequence[TensorEntry], max_read: int) -> list[torch.Tensor]:
    """Full tensors for ``entries``, read and verified (the exports of ``tools.convert``)."""
    targets = [torch.empty(e.shape, dtype=torch_dtype(e.dtype)) for e in entries]
    units = []
    for i, e in enumerate(entries):
        dt = targets[i].dtype
        units.extend((u, dt) for u in plan_reads(e, [(i, (tuple(0 for _ in e.shape), e.shape))], max_read))
    execute_reads(storage, units, targets, max_read=max_read)
    return targets
