"""How a save's writers store each chunk (``core.chunks.writer.ChunkPolicy``): compression, the keys stored
lossily, and the chunks of an incremental save's base they may reference instead of writing. A pure function of
the plan, the options and the storage's kind (the same on every rank), with the base as ``core.base`` gives it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from liferaft.core.chunks.writer import ChunkPolicy
from liferaft.core.commit import same_place
from liferaft.format.manifest import ChunkRecord, Manifest
from liferaft.options import SaveOptions
from liferaft.planning.references import sibling_of
from liferaft.planning.save_plan import SavePlan
from liferaft.storage import Storage
from liferaft.storage.refs import with_references


def chunk_policy(plan: SavePlan, storage: Storage, opts: SaveOptions, base: tuple[str, Manifest] | None
                 ) -> tuple[ChunkPolicy, dict[str, dict[str, Any]]]:
    """How the writers store each chunk (compression, lossy keys, reusable chunks of the base), and the lossy
    entries the manifest will describe: a function of its arguments only (the same on every rank, whatever
    earlier saves of the process did; ``codecs.advisor`` for ``compression="auto"``)."""
    from fnmatch import fnmatchcase

    from liferaft.codecs import advisor, frames, registry

    dtypes = {t.key: t.dtype for t in plan.tensors}
    quantizer = registry.get(registry.QUANTIZE)
    lossy = {t.key: quantizer.name for t in plan.tensors if quantizer.accepts(t.dtype) and t.kind == "tensor"
             and any(fnmatchcase(t.key, p) for p in opts.quantize)}
    reuse, delta = {}, {}
    if base is not None:
        name, manifest = base
        here: dict[str, bool] = {}      # (a checkpoint the base names that is the one being saved: its files go)

        def elsewhere(rebased: tuple[ChunkRecord, dict[str, int]]) -> bool:
            for f in rebased[1]:
                s = sibling_of(f) or ""
                if s not in here:
                    here[s] = same_place(storage, s)
                if here[s]:
                    return False
            return True
        for t in manifest.tensors:
            if dtypes.get(t.key) != t.dtype:
                continue
            xor = t.kind == "tensor" and any(fnmatchcase(t.key, p) for p in opts.delta)
            for c in t.chunks:
                box = (t.key, c.offsets, c.sizes)
                found = _rebased(c, name, manifest.files)
                if elsewhere(found):
                    reuse[box] = found
                if xor and t.lossy is None and elsewhere(found := _rebased(c.delta or c, name, manifest.files)):
                    delta[box] = found
    if opts.compression == "auto":       # a pure function of the options and the storage's kind
        compress = advisor.should_compress(storage.remote, opts.storage_write_bps, frames.threads())
    else:
        compress = opts.compression == "on"
    selective = {t.key: opts.selective for t in plan.tensors if opts.selective is not None and base is not None
                 and t.dtype in QUANTIZABLE and t.kind == "tensor" and t.key not in lossy
                 and any(fnmatchcase(t.key, p) for p in opts.selective_keys)}
    policy = ChunkPolicy(dtypes=dtypes, block_size=opts.block_size, alignment=opts.alignment, compress=compress, lossy=lossy,
                         reuse=reuse, delta=delta, reader=with_references(storage) if delta or selective else None,
                         selective=selective)
    described: dict[str, dict[str, Any]] = {k: {"method": c, **registry.get(c).params} for k, c in lossy.items()}
    described.update({k: {"method": "selective", "threshold": v} for k, v in selective.items()})
    return policy, described


def _rebased(rec: ChunkRecord, base: str, files: Mapping[str, int]) -> tuple[ChunkRecord, dict[str, int]]:
    """``rec`` of checkpoint ``base`` with its file names made relative to a sibling of ``base``, and the sizes
    of the files it needs."""
    def name(f: str) -> str:
        return f if f.startswith("../") else f"../{base}/{f}"

    sizes = {name(rec.file): files[rec.file]}
    delta = None
    if rec.delta is not None:
        delta = replace(rec.delta, file=name(rec.delta.file))
        sizes[delta.file] = files[rec.delta.file]
    return replace(rec, file=name(rec.file), delta=delta), sizes


QUANTIZABLE = ("float32", "bfloat16", "float16", "float64")


