"""The commit of a save whose chunk records live in per-rank chunk tables (format version 4, docs/FORMAT.md §4.6).

Each writing rank, once its data file is durable, writes the table of its chunks beside it (``write_table``)
and sends rank 0 only the table's name, size, digest and chunk count; rank 0 builds the index
(``build_index``): the tensors with their layouts, the files, the tables, the values and containers. What rank 0
receives to commit grows with the ranks, not with the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from liferaft.codecs.checksum import digest
from liferaft.errors import InvalidStateError
from liferaft.format.layout import data_file_name, table_file_name
from liferaft.format.manifest import DTYPE_ITEMSIZE, LEGACY_CHECKSUM, ContainerEntry, Manifest, TableRef, TensorEntry
from liferaft.format.tables import encode_table
from liferaft.planning.layouts import Layout
from liferaft.planning.save_plan import SavePlan, WriteItem, chunk_record
from liferaft.storage import Storage

assert LEGACY_CHECKSUM == "xxh3_64"         # the digest ``TableRef.hash`` records (``codecs.checksum.digest``)


def write_table(storage: Storage, save_id: str, rank: int, plan: SavePlan, writes: Sequence[WriteItem],
                stored: Sequence[Any]) -> tuple[TableRef, int]:
    """Write and make durable rank ``rank``'s chunk table (``stored[i]`` is how ``writes[i]`` was stored); its
    reference and size."""
    index = {t.key: i for i, t in enumerate(plan.tensors)}
    if len(stored) != len(writes):
        raise InvalidStateError(f"rank {rank} stored {len(stored)} chunks for {len(writes)} writes")
    data = encode_table(save_id, rank, [(index[w.key], chunk_record(w, sc)) for w, sc in zip(writes, stored)])
    name = table_file_name(save_id, rank)
    storage.put_atomic(name, data)
    storage.sync()
    return TableRef(file=name, rank=rank, hash=digest(data), chunks=len(writes)), len(data)


def build_index(plan: SavePlan, layouts: Sequence[Layout], rows: Sequence[tuple[TableRef | None, int, int, int]],
                *, save_id: str, values: tuple, containers: tuple[ContainerEntry, ...], created_unix: float,
                liferaft_version: str, torch_version: str, extra: dict, alignment: int, chunk_bytes: int
                ) -> Manifest:
    """The version 4 index of a save planned from ``layouts`` (``planning.layouts.plan_own``), from each rank's
    row: (its table or None, the table's size, its data file's size, the raw bytes it wrote). Refused
    (InvalidStateError) unless the ranks wrote exactly the tensors' bytes, once: the tables' chunks are the
    ranks' own plans, which tile every tensor by construction; this cheap sum catches plans that disagree."""
    wrote = sum(r[3] for r in rows)
    total = sum(math.prod(t.shape) * DTYPE_ITEMSIZE[t.dtype] for t in plan.tensors)
    if wrote != total:
        raise InvalidStateError(f"the ranks wrote {wrote} bytes of tensors holding {total}: their own plans "
                                "disagree; nothing was committed")
    files: dict[str, int] = {}
    refs = []
    for rank, (ref, table_size, file_size, _) in enumerate(rows):
        if file_size:
            files[data_file_name(save_id, rank)] = file_size
        if ref is not None:
            files[ref.file] = table_size
            refs.append(ref)
    tensors = tuple(TensorEntry(key=t.key, path=t.path, kind=t.kind, dtype=t.dtype, shape=t.shape, chunks=(),
                                per_rank=t.per_rank, layout=(la.mesh, la.shards))  # type: ignore[arg-type]
                    for t, la in zip(plan.tensors, layouts))
    return Manifest(save_id=save_id, world_size=plan.world_size, created_unix=created_unix,
                    liferaft_version=liferaft_version, torch_version=torch_version, files=files, tensors=tensors,
                    values=values, containers=containers, extra=dict(extra), version=4, tables=tuple(refs),
                    planned={"alignment": alignment, "chunk_bytes": chunk_bytes})
