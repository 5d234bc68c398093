"""Rank functions for the resharding matrix (imported by child processes as ``multiproc._reshard_ranks``)."""

from __future__ import annotations

from typing import Any

import torch

import liferaft

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((13, 10), torch.float32),
    "b": ((7,), torch.bfloat16),
    "c": ((6, 5, 4), torch.int64),
    "s": ((), torch.float64),
}


def reference(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = 1
    for x in shape:
        n *= x
    base = torch.arange(n, dtype=torch.float64).reshape(shape) * 1.25 - 3
    return base.to(dtype) if dtype != torch.int64 else torch.arange(n, dtype=torch.int64).reshape(shape) * 7 - 11


def _placements(tokens: list[str], ndim: int) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for t in tokens:
        d = int(t[1:]) if t.startswith("S") else -1
        out.append(Shard(d) if 0 <= d < ndim else Replicate())
    return out


def _mesh(world: int, mesh_shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    assert world == int(torch.tensor(mesh_shape).prod())
    return init_device_mesh("cpu", mesh_shape)


def build_state(rank: int, world: int, layout: dict[str, Any], fill: str) -> dict[str, Any]:
    """The state in ``layout``; ``fill`` = "ref" (saved values) or "zero" (a template to load into)."""
    state: dict[str, Any] = {"meta": {"step": 12, "name": "run"}, "rep": reference("a") if fill == "ref" else
                             torch.zeros(SHAPES["a"][0])}
    kind = layout["kind"]
    for name, (shape, dtype) in SHAPES.items():
        full = reference(name) if fill == "ref" else torch.zeros(shape, dtype=dtype)
        if kind == "dtensor":
            from torch.distributed.tensor import distribute_tensor

            mesh = _mesh(world, layout["mesh"])
            state[name] = distribute_tensor(full, mesh, _placements(layout["placements"], len(shape)))
        elif kind == "sharded":          # hand-made shards along dim 0; ranks r and r + parts are replicas
            parts = layout["parts"]
            if not shape:
                state[name] = full
                continue
            piece = rank % parts
            step = -(-shape[0] // parts)
            lo, hi = min(piece * step, shape[0]), min((piece + 1) * step, shape[0])
            state[name] = liferaft.Sharded(full[lo:hi].clone(), shape, (lo,) + (0,) * (len(shape) - 1))
        else:
            state[name] = full
    return state


def local_equals_reference(name: str, value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ref = reference(name)
    if isinstance(value, DTensor):
        shape, off = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        want = ref[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        return torch.equal(value.to_local(), want)
    if isinstance(value, liferaft.Sharded):
        want = ref[tuple(slice(o, o + s) for o, s in zip(value.offsets, value.local.shape))]
        return torch.equal(value.local, want)
    return torch.equal(value, ref)


def save_rank(rank: int, world: int, path: str, layout: dict[str, Any]) -> int:
    res = liferaft.save(path, build_state(rank, world, layout, "ref"))
    return res.bytes_written


def load_rank(rank: int, world: int, path: str, layout: dict[str, Any]) -> dict[str, bool]:
    state = build_state(rank, world, layout, "zero")
    liferaft.load(path, state)
    out = {name: local_equals_reference(name, state[name]) for name in SHAPES}
    out["rep"] = torch.equal(state["rep"], reference("a"))
    out["meta"] = state["meta"] == {"step": 12, "name": "run"}
    return out
