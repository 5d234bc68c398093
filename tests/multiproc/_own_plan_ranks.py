"""Rank functions for saves planned by each rank on its own (imported as ``multiproc._own_plan_ranks``)."""

from __future__ import annotations

from typing import Any

import torch

import liferaft
from liferaft.core.caches import PLANS

#: name -> (global shape, placements over the 2 × 2 mesh as tokens: "S<d>" shards dimension d, "R" replicates)
DTENSORS: dict[str, tuple[tuple[int, ...], tuple[str, str]]] = {
    "grid": ((10, 6), ("S0", "S1")),            # FSDP × TP
    "hsdp": ((9, 4), ("R", "S0")),              # replicated over the first mesh dimension
    "nested": ((11, 3), ("S0", "S0")),          # one dimension split twice: 3, 3, 3, 2 rows
    "tiny": ((3,), ("S0", "S0")),               # rank 3 holds nothing
    "rows": ((5, 2), ("S0", "R")),
    "whole": ((4, 4), ("R", "R")),
}
#: name -> (global shape, sub-mesh, its placement): DTensors on one dimension of the 2 × 2 mesh (FSDP2 on
#: mesh["dp"] beside tensor parallelism; TP alone on mesh["tp"]), described over the root mesh
SUB: dict[str, tuple[tuple[int, ...], str, str]] = {
    "on_dp": ((9, 6), "dp", "S1"),
    "on_tp": ((7, 4), "tp", "S0"),
}


def full(name: str) -> torch.Tensor:
    shape = DTENSORS[name][0] if name in DTENSORS else SUB[name][0] if name in SUB else (6, 7)
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 0.5 + len(name)).contiguous()


def _state(world: int, rank: int, plain_differs: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    state: dict[str, Any] = {}
    for name, (_, tokens) in DTENSORS.items():
        places = [Shard(int(t[1:])) if t.startswith("S") else Replicate() for t in tokens]
        state[name] = distribute_tensor(full(name), mesh, places)
    for name, (_, dim, token) in SUB.items():
        state[name] = distribute_tensor(full(name), mesh[dim], [Shard(int(token[1:]))])
    plain = full("plain")
    state["plain"] = plain + rank if plain_differs else plain
    state["rank"] = rank                                        # a value per rank
    state["step"] = 7
    state["vocab"] = {"words": [f"w{i}" for i in range(2000)]}   # a large value every rank holds alike
    state["seen"] = list(range(rank * 100))                      # a large value that differs (empty on rank 0)
    return state


def save(rank: int, world: int, path: str, plain_differs: bool = False, again: str | None = None) -> Any:
    """Save the state to ``path`` (and then to ``again``); return how each save was planned on this rank."""
    state = _state(world, rank, plain_differs)
    kinds = []
    for p in [path] + ([again] if again else []):
        r = liferaft.save(p, state)
        kinds.append(planned_how())
        assert r.total_bytes > 0 and r.files >= 1
    return kinds, r.total_bytes, r.files


def planned_how() -> str:
    """How the last save of this process was planned: "layouts" (on its own) or "gathered"."""
    planned_from = PLANS.items()[-1][1][0]
    return "layouts" if planned_from[:1] == ("layouts",) else "gathered"


def fail_on(rank: int, world: int, path: str, bad_rank: int) -> str:
    """A save where ``bad_rank`` holds a value that cannot be saved: every rank must raise."""
    state = _state(world, rank, False)
    if rank == bad_rank:
        state["bad"] = object()
    try:
        liferaft.save(path, state)
    except liferaft.LiferaftError as e:
        return type(e).__name__
    return "saved"
