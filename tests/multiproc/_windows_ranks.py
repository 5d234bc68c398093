"""Rank functions for the tools' windowed reads of chunk tables (imported as ``multiproc._windows_ranks``): an
FSDP-style checkpoint of many tensors, each rank holding rows of each."""

from __future__ import annotations

from typing import Any

import torch

import liferaft

NAMES = [f"layer{i}.{p}" for i in range(6) for p in ("weight", "bias")]


def tensors(seed: int, changed: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn((96, 64) if k.endswith("weight") else (96,), generator=g) for k in NAMES}
    if changed is not None:
        out[changed] = out[changed] + 1
    return out


def save(rank: int, world: int, path: str, seed: int, changed: str | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tensors(seed, changed).items()}
    state["step"] = seed
    liferaft.save(path, state, options=liferaft.SaveOptions(chunk_bytes=64 << 10))
