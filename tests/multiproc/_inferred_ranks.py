"""Rank functions for hand-made shards whose layouts are inferred (imported as ``multiproc._inferred_ranks``)."""

from __future__ import annotations

from typing import Any

import torch

import liferaft
from liferaft.core.caches import INFERRED, PLANS

#: name -> (global shape, each rank's (row offset, rows, column offset, columns) on 4 ranks)
HANDMADE: dict[str, tuple[tuple[int, int], list[tuple[int, int, int, int]]]] = {
    # Megatron-style TP 2 row shards, replicated over DP 2 (each box held by 2 ranks: rank % 2 picks it)
    "tp_rows": ((8, 5), [(0, 4, 0, 5), (4, 4, 0, 5), (0, 4, 0, 5), (4, 4, 0, 5)]),
    # rows by rank // 2, replicas next to each other
    "dp_rows": ((9, 3), [(0, 5, 0, 3), (0, 5, 0, 3), (5, 4, 0, 3), (5, 4, 0, 3)]),
    # columns over all 4 ranks, torch.chunk's uneven split (3, 3, 3, 1)
    "cols": ((2, 10), [(0, 2, 0, 3), (0, 2, 3, 3), (0, 2, 6, 3), (0, 2, 9, 1)]),
    # a 2 × 2 grid: rows by rank // 2, columns by rank % 2
    "grid": ((6, 7), [(0, 3, 0, 4), (0, 3, 4, 3), (3, 3, 0, 4), (3, 3, 4, 3)]),
}
#: hand-made shards no layout describes (each is saved through the gathered plan, exactly)
IRREGULAR: dict[str, tuple[tuple[int, int], list[tuple[int, int, int, int]]]] = {
    # rows split 4, 3, 3 (not torch.chunk's 4, 4, 2) over ranks 0-2, rank 3 a replica of rank 0
    "array_split": ((10, 2), [(0, 4, 0, 2), (4, 3, 0, 2), (7, 3, 0, 2), (0, 4, 0, 2)]),
    # the probes (ranks 0, 1, 2) follow "rows by rank // 2", rank 3 does not: it holds rank 0's rows again
    "odd_last": ((8, 2), [(0, 4, 0, 2), (0, 4, 0, 2), (4, 4, 0, 2), (0, 4, 0, 2)]),
}


def full(name: str) -> torch.Tensor:
    shape = {**HANDMADE, **IRREGULAR}[name][0] if name != "plain" else (3, 3)
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + 100 * len(name)).contiguous()


def _shard(name: str, rank: int, table: dict[str, Any]) -> liferaft.Sharded:
    shape, boxes = table[name]
    r0, nr, c0, nc = boxes[rank]
    return liferaft.Sharded(full(name)[r0:r0 + nr, c0:c0 + nc].clone(), shape, (r0, c0))


def _permuted_dtensor(ranks: list[list[int]], replicate_last: bool = False) -> Any:
    """A DTensor on a 2 × 2 mesh holding the ranks in another order, sharded along both dimensions (or along the
    first only, replicated along the second)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.tensor(ranks))
    return distribute_tensor(torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6), mesh,
                             [Shard(0), Replicate() if replicate_last else Shard(1)])


def _sub_of_permuted() -> Any:
    """A DTensor row-sharded over the "dp" sub-mesh of a 2 × 2 (dp, tp) mesh that holds the ranks transposed
    (rank 1 at dp 1, tp 0): replicated over tp. Its spec over the root would take the root's ranks in row-major
    order (rank 1 at dp 0): no layout is claimed, the save is gathered."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("dp", "tp"))
    return distribute_tensor(torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6), root["dp"], [Shard(0)])


def state(rank: int, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {n: _shard(n, rank, HANDMADE) for n in names if n in HANDMADE}
    out.update({n: _shard(n, rank, IRREGULAR) for n in names if n in IRREGULAR})
    if "permuted" in names:         # (transposed: rank 0 at the mesh's origin; a layout describes it)
        out["permuted"] = _permuted_dtensor([[0, 2], [1, 3]])
    if "rotated" in names:          # (rank 1 at the origin: no layout over the ranks in order describes it)
        out["rotated"] = _permuted_dtensor([[1, 0], [3, 2]])
    if "sub_of_permuted" in names:
        out["sub_of_permuted"] = _sub_of_permuted()
    if "replicated_down" in names:  # (ranks decreasing along a dimension that only replicates: its boxes hold)
        out["replicated_down"] = _permuted_dtensor([[0, 1], [3, 2]], replicate_last=True)
    out["plain"] = full("plain")
    out["step"] = 3
    return out


def save(rank: int, world: int, paths: list[str], names: tuple[str, ...]) -> Any:
    """Save the state to each of ``paths`` (the plain tensor every rank holds alike changed before each save);
    return how each save was planned on this rank and how many layouts it keeps inferred."""
    kinds = []
    st = state(rank, names)
    for i, p in enumerate(paths):
        st["plain"] = full("plain") + i
        liferaft.save(p, st)
        planned_from = PLANS.items()[-1][1][0]
        kinds.append("layouts" if planned_from[:1] == ("layouts",) else "gathered")
    return kinds, len(INFERRED)


def load_rows(rank: int, world: int, path: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Each of ``world`` ranks loads a row block of every tensor of ``names`` (a resharding load)."""
    out = {}
    for name in names:
        shape = {**HANDMADE, **IRREGULAR}[name][0] if name in {**HANDMADE, **IRREGULAR} else (8, 6)
        lo, hi = rank * shape[0] // world, (rank + 1) * shape[0] // world
        out[name] = liferaft.Sharded(torch.zeros(hi - lo, shape[1]), shape, (lo, 0))
    liferaft.load(path, out, options=liferaft.LoadOptions(ignore_keys=("plain", "step")))
    return {k: v.local.tolist() for k, v in out.items()}


def save_rotated(rank: int, world: int, path: str) -> str:
    """Save a DTensor on a mesh whose second dimension lists its ranks in decreasing order: refused."""
    try:
        liferaft.save(path, state(rank, ("rotated",)))
    except liferaft.InvalidStateError as e:
        return str(e)
    return "saved"


def load_expect_error(rank: int, world: int, path: str, names: tuple[str, ...]) -> str:
    """``load_rows`` expecting it to fail: the error's type and message."""
    try:
        load_rows(rank, world, path, names)
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def save_tables_differ(rank: int, world: int, path: str, names: tuple[str, ...]) -> str:
    """Save with ``chunk_tables`` on rank 0 only: refused on every rank."""
    try:
        liferaft.save(path, state(rank, names), options=liferaft.SaveOptions(chunk_tables=rank == 0))
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def save_with_empty(rank: int, world: int, path: str, base: str | None = None) -> None:
    """A gathered save (explicit boxes) holding empty tensors beside an irregular hand-made shard; with ``base``,
    an incremental save on it (nothing changed)."""
    st = state(rank, ())
    lo, n = ((0, 7), (7, 3))[rank]                  # (rows split 7 / 3: not torch.chunk's 5 / 5)
    st["array_split"] = liferaft.Sharded(full("array_split")[lo:lo + n].clone(), (10, 2), (lo, 0))
    st["empty"] = torch.zeros(0, 4)
    st["empty_sharded"] = liferaft.Sharded(torch.zeros(0, 3), (0, 3), (0, 0))
    liferaft.save(path, st, options=liferaft.SaveOptions(incremental_base=base))


def load_with_empty(rank: int, world: int, path: str) -> bool:
    out: dict[str, Any] = {"array_split": liferaft.Sharded(torch.zeros(5, 2), (10, 2), (5 * rank, 0)),
                           "empty": torch.ones(0, 4), "empty_sharded": torch.ones(0, 3)}
    liferaft.load(path, out, options=liferaft.LoadOptions(ignore_keys=("plain", "step")))
    return torch.equal(out["array_split"].local, full("array_split")[5 * rank:5 * rank + 5])

