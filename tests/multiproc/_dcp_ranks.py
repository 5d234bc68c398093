"""Rank functions for DCP interop across layouts (imported as ``multiproc._dcp_ranks``)."""

from __future__ import annotations

import torch

import liferaft


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return {"w": torch.randn(12, 10, generator=g), "b": torch.randn(7, generator=g),
            "h": torch.randn(9, 4, generator=g).to(torch.bfloat16)}[name]


def _dtensor(name: str, dim: int) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return distribute_tensor(full(name), mesh, [Shard(dim)])


def dcp_save_sharded(rank: int, world: int, path: str) -> None:
    """DCP's own save of row-sharded DTensors, a plain replicated tensor and values: one chunk per rank."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": _dtensor("w", 0), "h": _dtensor("h", 0)}, "b": full("b"), "step": 11,
             "sched": {"last_epoch": 3, "lrs": [0.1, 0.01]}}
    dcp.save(state, checkpoint_id=path)


def load_dcp_other_layout(rank: int, world: int, path: str) -> list[bool]:
    """liferaft.load from the DCP folder into column-sharded DTensors and a Sharded with two boxes per rank."""
    half = 6 // world
    w = liferaft.Sharded(torch.zeros(half, 10), (12, 10), (rank * half, 0),
                         more=[((6 + rank * half, 0), torch.zeros(half, 10))])
    state = {"model": {"w": w, "h": _dtensor("h", 1).zero_()}, "b": torch.zeros(7), "step": 0,
             "sched": {"last_epoch": 0, "lrs": []}}
    liferaft.load(path, state)
    h = state["model"]["h"].full_tensor()
    return [torch.equal(w.local, full("w")[rank * half:(rank + 1) * half]),
            torch.equal(w.more[0][1], full("w")[6 + rank * half:6 + (rank + 1) * half]),
            torch.equal(h, full("h")), torch.equal(state["b"], full("b")), state["step"] == 11,
            state["sched"] == {"last_epoch": 3, "lrs": [0.1, 0.01]}]


def liferaft_save_sharded(rank: int, world: int, path: str) -> None:
    liferaft.save(path, {"model": {"w": _dtensor("w", 1), "h": _dtensor("h", 0)}, "b": full("b"), "step": 11})


def dcp_load_export(rank: int, world: int, path: str) -> list[bool]:
    """DCP's own loader reads liferaft's DCP export (row-slab chunks) into row-sharded DTensors."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": _dtensor("w", 0).zero_(), "h": _dtensor("h", 1).zero_()}, "b": torch.zeros(7),
             "step": 0}
    dcp.load(state, checkpoint_id=path)
    return [torch.equal(state["model"]["w"].full_tensor(), full("w")),
            torch.equal(state["model"]["h"].full_tensor(), full("h")), torch.equal(state["b"], full("b")),
            state["step"] == 11]


def load_dcp_one_rank_wrong(rank: int, world: int, path: str) -> tuple[str, int]:
    """Rank 1 holds a wrong shape: every rank raises (the one pipeline exchanges every rank's outcome), and nothing
    of rank 0's state changed; with matching states each rank reports its own rank."""
    w = torch.zeros(12, 10 if rank == 0 else 11)
    state = {"model": {"w": w}}
    try:
        liferaft.load(path, state, strict=False)
    except liferaft.LiferaftError as e:
        outcome = type(e).__name__
    else:
        outcome = "loaded"
    ok = {"model": {"w": torch.zeros(12, 10)}}
    res = liferaft.load(path, ok, strict=False)
    return outcome + ("" if torch.count_nonzero(w) == 0 else " (changed)"), res.rank
