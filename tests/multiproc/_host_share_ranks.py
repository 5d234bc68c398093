"""Rank functions for the same-host shared-memory read tests (imported by child processes as
``multiproc._host_share_ranks``)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

import liferaft
from liferaft import LiferaftError, LoadOptions, SaveOptions

TIMEOUT = 60.0
SHAPES = {"a": (1024, 1024), "b": (2048, 512), "c": (301, 4000), "d": (1_000_000,)}     # 4, 4, 4.8, 4 MB
PLACEMENTS = {"S0": "Shard(0)", "S1": "Shard(1)", "R": "Replicate()"}


def reference(name: str) -> torch.Tensor:
    """Values whose low mantissa bits are zero, so that compression="on" really shrinks them."""
    g = torch.Generator().manual_seed(sorted(SHAPES).index(name) + 7)
    t = torch.randn(SHAPES[name], generator=g)
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)


def _mesh_and_placements(world: int, layout: str) -> tuple[Any, list[Any], list[Any]]:
    """``layout``: placements by ``,`` over a mesh (``S0``, ``S1``, ``R``; ``S0,S1`` = a 2 x (world/2) mesh);
    1-D tensors are Shard(0) where 2-D ones are Shard(1), replicated otherwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    names = layout.split(",")
    mesh = init_device_mesh("cpu", (world,) if len(names) == 1 else (2, world // 2))
    make = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    two = [make[n] for n in names]
    one = [Shard(0) if n == "S0" else Replicate() for n in names]
    return mesh, two, one


def build(world: int, layout: str, fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    mesh, two, one = _mesh_and_placements(world, layout)
    return {k: distribute_tensor(reference(k) if fill else torch.zeros(SHAPES[k]), mesh,
                                 two if len(SHAPES[k]) == 2 else one) for k in SHAPES}


def save(rank: int, world: int, path: str, layout: str, compression: str) -> None:
    liferaft.save(path, build(world, layout, True), options=SaveOptions(timeout=TIMEOUT, compression=compression))


def load_both(rank: int, world: int, path: str, layout: str) -> dict[str, Any]:
    """Load into ``layout`` with same-host sharing (``share_reads=True`` on local files) and without; compare the local
    shards bitwise with each other and with the reference."""
    shared, plain = build(world, layout, False), build(world, layout, False)
    res = liferaft.load(path, shared, options=LoadOptions(timeout=TIMEOUT, share_reads=True))
    off = liferaft.load(path, plain, options=LoadOptions(timeout=TIMEOUT, share_reads=False))
    same = all(torch.equal(shared[k].to_local().view(torch.int32), plain[k].to_local().view(torch.int32))
               for k in SHAPES)
    right = all(torch.equal(shared[k].full_tensor().view(torch.int32), reference(k).view(torch.int32))
                for k in SHAPES)
    return {"same": same, "right": right, "read": res.bytes_read, "received": res.bytes_received,
            "off_received": off.bytes_received}


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"liferaft-load-{pid}-")]


def load_killed(rank: int, world: int, path: str, pids: str, victim: int) -> tuple[str, str, float]:
    """Rank ``victim`` kills itself (SIGKILL) once its segment was made and unlinked, i.e. in the shared reads;
    the others report how their load ended and how long it took."""
    with open(os.path.join(pids, f"{rank}"), "w") as f:
        f.write(str(os.getpid()))
    state = build(world, "S1", False)
    if rank == victim:
        def watch() -> None:
            seen = False
            while True:
                mine = _segments_of(os.getpid())
                seen = seen or bool(mine)
                if seen and not mine:
                    os.kill(os.getpid(), 9)
                time.sleep(0.0005)
        threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    try:
        liferaft.load(path, state, options=LoadOptions(timeout=10.0, share_reads=True))
        out = ("ok", "", time.perf_counter() - t0)
    except LiferaftError as e:
        out = (type(e).__name__, str(e), time.perf_counter() - t0)
    with open(os.path.join(pids, f"{rank}.out"), "w") as f:        # (run_ranks raises: a rank died)
        f.write(repr(out))
    return out


def load_two_hosts(rank: int, world: int, path: str) -> dict[str, Any]:
    """Ranks 0, 1 on "host-a" and 2, 3 on "host-b" (the seam: ``shm.host_key``) load every tensor replicated: each
    host's ranks exchange their spans among themselves and share within the host only."""
    from liferaft.core.chunks import shm

    shm.host_key = lambda: "host-a" if rank < world // 2 else "host-b"
    state = build(world, "R", False)
    res = liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT, share_reads=True))
    right = all(torch.equal(state[k].to_local().view(torch.int32), reference(k).view(torch.int32)) for k in SHAPES)
    return {"right": right, "read": res.bytes_read, "received": res.bytes_received}
