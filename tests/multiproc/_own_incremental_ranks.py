"""Rank functions for incremental saves each rank plans on its own (imported as
``multiproc._own_incremental_ranks``): FSDP-style DTensors over a mesh of the ranks, a base read rank by rank
from its chunk tables (format version 6)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import liferaft
from liferaft.core.caches import PLANS

ROWS, COLS = 512, 256           # float32: 1 KiB per row; 16 KiB chunks (chunk_bytes below)
CHUNK = 64 << 10


def tensors_at(step: int, frozen_rows: int) -> dict[str, torch.Tensor]:
    """``w`` changes at every step, ``frozen`` never, ``bias`` (held whole by every rank) never."""
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(100 + step))
    frozen = torch.randn(frozen_rows, COLS, generator=torch.Generator().manual_seed(7))
    bias = torch.arange(300, dtype=torch.float32)
    return {"w": w, "frozen": frozen, "bias": bias}


def state_at(world: int, step: int, frozen_rows: int, mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape or (world,))
    full = tensors_at(step, frozen_rows)
    places = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    return {"w": distribute_tensor(full["w"], mesh, places), "frozen": distribute_tensor(full["frozen"], mesh, places),
            "bias": full["bias"].clone(), "step": step}


def _index(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "COMMIT")) as f:
        marker = json.load(f)
    with open(os.path.join(path, marker["manifest"])) as f:
        return json.load(f)


def _tables(path: str, index: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in index.get("tables", []):
        with open(os.path.join(path, t["file"])) as f:
            out.append(json.load(f))
    return out


def save_two(rank: int, world: int, root: str, frozen_rows: int, min_share: float = 0.1,
             mesh_shape: tuple[int, ...] | None = None, tables: bool = True) -> dict[str, Any]:
    """Save step 0 fully to ``root/a``, step 1 to ``root/b`` with ``a`` as its incremental base; report how the
    second save was planned and what its index and tables say."""
    opts = dict(chunk_bytes=CHUNK, timeout=60, chunk_tables=tables)
    liferaft.save(os.path.join(root, "a"), state_at(world, 0, frozen_rows, mesh_shape),
                  options=liferaft.SaveOptions(**opts))
    res = liferaft.save(os.path.join(root, "b"), state_at(world, 1, frozen_rows, mesh_shape),
                        options=liferaft.SaveOptions(incremental_base="a", reference_min_share=min_share, **opts))
    planned = [v for k, v in PLANS.items() if k[1] == rank]
    own = bool(planned) and getattr(planned[-1][1], "own", False)
    path = os.path.join(root, "b")
    index = _index(path)
    files = sorted(f for tb in _tables(path, index) for _, c in tb["chunks"] for f in [c["file"]])
    inline = sorted(c["file"] for t in index["tensors"] for c in t["chunks"])
    return {"own": own, "version": index["version"], "reused": res.bytes_reused, "written": res.bytes_written,
            "table_files": sorted(set(files)), "inline_files": sorted(set(inline)),
            "index_files": sorted(index["files"])}


def load_check(rank: int, world: int, path: str, step: int, frozen_rows: int,
               mesh_shape: tuple[int, ...] | None = None) -> bool:
    """Load ``path`` into a zeroed state of ``world`` ranks: is every value exactly step ``step``'s?"""
    st = state_at(world, -1, frozen_rows, mesh_shape)
    for k in ("w", "frozen"):
        st[k].to_local().zero_()
    st["bias"].zero_()
    liferaft.load(path, st)
    want = tensors_at(step, frozen_rows)
    return all(torch.equal(st[k].full_tensor(), want[k]) for k in ("w", "frozen")) and \
        torch.equal(st["bias"], want["bias"]) and st["step"] == step


def save_chain(rank: int, world: int, root: str, frozen_rows: int) -> list[str]:
    """Steps 0, 1, 2 to ``a``, ``b`` (base ``a``), ``c`` (base ``b``): the files ``c``'s chunk tables name."""
    opts = dict(chunk_bytes=CHUNK, timeout=60)
    for step, (name, base) in enumerate((("a", None), ("b", "a"), ("c", "b"))):
        liferaft.save(os.path.join(root, name), state_at(world, step, frozen_rows),
                      options=liferaft.SaveOptions(incremental_base=base, **opts))
    path = os.path.join(root, "c")
    return sorted({c["file"] for tb in _tables(path, _index(path)) for _, c in tb["chunks"]})


def save_full(rank: int, world: int, path: str, step: int, frozen_rows: int,
              mesh_shape: tuple[int, ...] | None = None) -> None:
    liferaft.save(path, state_at(world, step, frozen_rows, mesh_shape),
                  options=liferaft.SaveOptions(chunk_bytes=CHUNK, timeout=60))


def save_on(rank: int, world: int, root: str, base: str, step: int, frozen_rows: int, delta: bool = False
            ) -> dict[str, Any]:
    """Save step ``step`` to ``root/b`` with ``base`` (a sibling) as its incremental base (``delta``: XOR deltas
    of ``w``, which plans it gathered); the warnings raised and how it was planned."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = liferaft.save(os.path.join(root, "b"), state_at(world, step, frozen_rows),
                            options=liferaft.SaveOptions(chunk_bytes=CHUNK, timeout=60, incremental_base=base,
                                                         delta=["w"] if delta else []))
    planned = [v for k, v in PLANS.items() if k[1] == rank]
    return {"reused": res.bytes_reused, "warnings": [str(w.message) for w in caught],
            "own": bool(planned) and getattr(planned[-1][1], "own", False)}


def manager_run(rank: int, world: int, root: str, frozen_rows: int) -> dict[str, Any]:
    """A ``CheckpointManager`` saving steps 0..3 of DTensors (each save incremental on the one before, planned on
    each rank), then restoring the newest into a zeroed state: exact? which steps are kept, and on what do
    they depend?"""
    from liferaft import CheckpointManager
    from liferaft.manager.manager import list_steps
    from liferaft.storage import resolve

    mgr = CheckpointManager(root, every_steps=1, keep_last=2,
                            save_options=liferaft.SaveOptions(timeout=60, chunk_bytes=CHUNK))
    for step in range(4):
        mgr.maybe_save(step, state_at(world, step, frozen_rows))
    mgr.wait()
    fresh = state_at(world, -1, frozen_rows)
    for k in ("w", "frozen"):
        fresh[k].to_local().zero_()
    restored = mgr.restore(fresh)
    mgr.close()
    want = tensors_at(3, frozen_rows)
    exact = all(torch.equal(fresh[k].full_tensor(), want[k]) for k in ("w", "frozen")) and fresh["step"] == 3
    versions = {i.step: _index(os.path.join(root, f"step-{i.step:010d}"))["version"]
                for i in list_steps(resolve(root))}
    return {"restored": restored, "exact": exact, "steps": {i.step: i.depends_on for i in list_steps(resolve(root))},
            "versions": versions}


def stage_state(rank: int, step: int) -> dict[str, Any]:
    """PP 2 × FSDP 2: stage ``s`` holds ``s<s>.w`` (changes at every step) and ``s<s>.frozen`` (never), each
    ``Shard(0)`` over its stage's sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s = rank // 2
    full = stage_tensors(s, step)
    return {k: distribute_tensor(v, mesh["dp"], [Shard(0)]) for k, v in full.items()} | {"step": step}


def stage_tensors(s: int, step: int) -> dict[str, torch.Tensor]:
    return {f"s{s}.w": torch.randn(128, COLS, generator=torch.Generator().manual_seed(10 * s + step)),
            f"s{s}.frozen": torch.randn(128, COLS, generator=torch.Generator().manual_seed(100 + s))}


def save_stages_async(rank: int, world: int, root: str) -> dict[str, Any]:
    """Pipeline stages: step 0 to ``a``, step 1 to ``b`` on ``a`` with ``async_save``: how ``b`` was planned."""
    from liferaft.core.caches import STAGED

    opts = dict(chunk_bytes=CHUNK, timeout=60)
    liferaft.save(os.path.join(root, "a"), stage_state(rank, 0), options=liferaft.SaveOptions(**opts))
    fut = liferaft.async_save(os.path.join(root, "b"), stage_state(rank, 1),
                              options=liferaft.SaveOptions(incremental_base="a", **opts))
    assert fut is not None
    res = fut.wait()
    path = os.path.join(root, "b")
    index = _index(path)
    files = sorted({c["file"] for tb in _tables(path, index) for _, c in tb["chunks"]})
    return {"staged": len(STAGED) > 0, "version": index["version"], "reused": res.bytes_reused, "files": files}


def committed_index_is_decoded_index(rank: int, world: int, root: str) -> list[str]:
    """Rank 0 keeps the index it commits (``core.commit.INDEXES``) so that the next incremental save need not
    decode it: save FSDP-style (version 4), incrementally on it (6), explicit boxes (hand-made shards split 7 / 3,
    planned gathered) and, on 4 ranks, pipeline stages (5); on rank 0, the paths whose kept index differs from
    what its bytes decode to (field by field)."""
    from liferaft.codecs import registry
    from liferaft.codecs.checksum import digest
    from liferaft.core.commit import INDEXES, read_verified
    from liferaft.format.manifest import decode_manifest
    from liferaft.storage import resolve

    save_two(rank, world, root, 256)
    paths = [os.path.join(root, "a"), os.path.join(root, "b"), os.path.join(root, "boxes")]
    lo, n = ((0, 7), (7, 3))[rank % 2]
    rows = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    liferaft.save(paths[2], {"r": liferaft.Sharded(rows[lo:lo + n].clone(), (10, 2), (lo, 0)), "step": 1},
                  options=liferaft.SaveOptions(metadata={"cfg": {"lr": 0.1}, "dims": (1, 2)}))
    if world == 4:
        paths.append(os.path.join(root, "stages"))
        liferaft.save(paths[-1], stage_state(rank, 0), options=liferaft.SaveOptions(chunk_bytes=CHUNK))
    if rank != 0:
        return []
    out = []
    for path in paths:
        storage = resolve(path)
        data, _ = read_verified(storage)
        kept = INDEXES.get((storage.url, digest(data), len(data), registry.names()))
        decoded = decode_manifest(data, codecs=registry.names())
        if kept is None:
            out.append(f"{path}: not kept")
            continue
        out += [f"{path}: {f}" for f in decoded.__dataclass_fields__ if getattr(kept, f) != getattr(decoded, f)]
    return out


def delta_then_plain(rank: int, world: int, root: str) -> dict[str, Any]:
    """``a`` full; ``b`` on ``a`` with ``w`` stored as XOR deltas (planned gathered); ``c`` on ``b`` without
    deltas, ``w`` unchanged since ``b`` (planned on each rank): does ``c`` load exactly? Its version."""
    opts = dict(chunk_bytes=CHUNK, timeout=60)
    liferaft.save(os.path.join(root, "a"), state_at(world, 0, 256), options=liferaft.SaveOptions(**opts))
    liferaft.save(os.path.join(root, "b"), state_at(world, 1, 256),
                  options=liferaft.SaveOptions(incremental_base="a", delta=["w"], **opts))
    liferaft.save(os.path.join(root, "c"), state_at(world, 1, 256),
                  options=liferaft.SaveOptions(incremental_base="b", **opts))
    return {"version": _index(os.path.join(root, "c"))["version"]}


def overwrite_on_a_base_referencing_it(rank: int, world: int, root: str) -> int:
    """``b`` full, ``a`` on ``b`` (referencing ``b``'s files), then ``b`` saved again over itself with ``a`` as
    its base: the new ``b`` must not reference the files its own commit removes. The new ``b``'s version."""
    opts = dict(chunk_bytes=CHUNK, timeout=60)
    liferaft.save(os.path.join(root, "b"), state_at(world, 0, 256), options=liferaft.SaveOptions(**opts))
    liferaft.save(os.path.join(root, "a"), state_at(world, 1, 256),
                  options=liferaft.SaveOptions(incremental_base="b", **opts))
    liferaft.save(os.path.join(root, "b"), state_at(world, 1, 256),
                  options=liferaft.SaveOptions(incremental_base="a", overwrite=True, **opts))
    return int(_index(os.path.join(root, "b"))["version"])
