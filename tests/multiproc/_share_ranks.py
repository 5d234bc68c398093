"""Rank functions for the shared-read tests (imported by child processes as ``multiproc._share_ranks``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import liferaft
from liferaft import LiferaftError, LoadOptions

TIMEOUT = 60.0
BIG = {"a": (512, 1024), "b": (1024, 512), "c": (300_000,)}     # 2 MiB, 2 MiB, 1.2 MB: shared spans
SMALL = {"s": (64, 64)}                                          # 16 KiB: below MIN_SHARED_BYTES
MANY = {"big": (512, 1024), **{f"m{i:03d}": (32, 32) for i in range(150)}}   # 2 MiB, then 150 x 4 KiB: more
                                                                               # spans than one notice tells


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(shape, generator=g) for k, shape in {**BIG, **SMALL}.items()}


def load_replicated(rank: int, world: int, path: str, share: bool, atomic: bool = False) -> tuple[Any, ...]:
    """Every rank loads every tensor whole (a data-parallel restart). Returns (outcome, equal, read, received)."""
    state = {k: torch.full_like(v, -1.0) for k, v in reference().items()}
    before = copy.deepcopy(state)
    try:
        res = liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT, share_reads=share, atomic=atomic))
    except LiferaftError as e:
        unchanged = all(torch.equal(state[k], before[k]) for k in state)
        return type(e).__name__, str(e), unchanged
    equal = all(torch.equal(state[k], v) for k, v in reference().items())
    return "ok", equal, res.bytes_read, res.bytes_received


def save_rows(rank: int, world: int, path: str) -> None:
    """Save the big 2-D tensors as Shard(0) DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    state = {k: distribute_tensor(ref[k], mesh, [Shard(0)]) for k in ("a", "b")}
    liferaft.save(path, state, options=liferaft.SaveOptions(timeout=TIMEOUT))


def load_columns(rank: int, world: int, path: str, dim: int = 1) -> tuple[bool, int, int, list[int]]:
    """Load them as Shard(``dim``) (1: every rank needs every row, i.e. the same hash blocks; 0: the layout they
    were saved in, nothing to share). Returns (equal, read, received, the slot sizes of the shared-memory segments
    this rank made)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from liferaft.core.chunks import shm

    made: list[int] = []
    create = shm.Segment.create

    def counted(name: str, slot_bytes: int, slots: int = shm.SLOTS, reserve: int | None = None) -> shm.Segment:
        made.append(slot_bytes)
        return create(name, slot_bytes, slots, reserve)
    shm.Segment.create = counted            # (recorded, then the real segment is made)
    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    state = {k: distribute_tensor(torch.zeros_like(ref[k]), mesh, [Shard(dim)]) for k in ("a", "b")}
    res = liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT, share_reads=True))
    equal = all(torch.equal(state[k].full_tensor(), ref[k]) for k in ("a", "b"))
    return equal, res.bytes_read, res.bytes_received, made


def many_reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {k: torch.randn(shape, generator=g) for k, shape in MANY.items()}


def load_many(rank: int, world: int, path: str) -> tuple[Any, ...]:
    """Every rank loads the ``MANY`` small tensors whole, sharing reads. Returns (outcome, equal or message, read,
    received)."""
    state = {k: torch.full_like(v, -1.0) for k, v in many_reference().items()}
    try:
        res = liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT, share_reads=True))
    except LiferaftError as e:
        return type(e).__name__, str(e)
    equal = all(torch.equal(state[k], v) for k, v in many_reference().items())
    return "ok", equal, res.bytes_read, res.bytes_received
