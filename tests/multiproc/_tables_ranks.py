"""Rank functions for checkpoints whose chunks live in per-rank chunk tables (format version 4; imported as
``multiproc._tables_ranks``)."""

from __future__ import annotations

from typing import Any

import torch

import liferaft

#: name -> (global shape, placement over a 1-d mesh of every rank: "S<d>" shards dimension d, "R" replicates)
TENSORS: dict[str, tuple[tuple[int, ...], str]] = {
    "rows": ((256, 160), "S0"),         # 160 KiB: several 64 KiB chunks per rank at 2 ranks
    "cols": ((33, 20), "S1"),
    "uneven": ((7, 3), "S0"),           # 2, 2, 2, 1 rows at 4 ranks
    "tiny": ((3,), "S0"),               # rank 3 of 4 holds nothing
    "repl": ((300, 128), "R"),          # 150 KiB held by every rank: 3 chunks shared out among them
}
CHUNK = 64 << 10


def full(name: str) -> torch.Tensor:
    shape = TENSORS[name][0] if name in TENSORS else (300, 64)
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 0.25 + len(name)).contiguous()


def _state(world: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for name, (shape, token) in TENSORS.items():
        place = Shard(int(token[1:])) if token.startswith("S") else Replicate()
        state[name] = distribute_tensor(torch.zeros(shape) if zeros else full(name), mesh, [place])
    state["plain"] = torch.zeros(300, 64) if zeros else full("plain")       # a plain tensor held whole by every rank
    state["step"] = 0 if zeros else 11
    return state


def save(rank: int, world: int, path: str, tables: bool = True) -> Any:
    """Save the state with ``chunk_tables=tables``; the save's result as plain data."""
    r = liferaft.save(path, _state(world, False), options=liferaft.SaveOptions(chunk_bytes=CHUNK, chunk_tables=tables))
    return r.total_bytes, r.files


def load(rank: int, world: int, path: str) -> Any:
    """Load into the same layout over ``world`` ranks; (tables read, every tensor exact, the step)."""
    state = _state(world, True)
    r = liferaft.load(path, state)
    exact = all(torch.equal(state[n].full_tensor(), full(n)) for n in TENSORS) and torch.equal(state["plain"],
                                                                                                full("plain"))
    return r.tables_read, exact, state["step"]


def load_one(rank: int, world: int, path: str, name: str) -> Any:
    """Load only the rows of tensor ``name`` this rank holds under Shard(0) over ``world`` ranks, as a
    ``liferaft.Sharded``; (tables read, exact)."""
    shape = TENSORS[name][0]
    lo, hi = rank * shape[0] // world, (rank + 1) * shape[0] // world
    out = {name: liferaft.Sharded(torch.zeros((hi - lo,) + shape[1:]), shape, (lo,) + (0,) * (len(shape) - 1))}
    r = liferaft.load(path, out, strict=False)
    return r.tables_read, torch.equal(out[name].local, full(name)[lo:hi])


def load_expect_error(rank: int, world: int, path: str) -> str:
    """A load that must fail on every rank: the error's type and message."""
    try:
        liferaft.load(path, _state(world, True))
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _odd_state(world: int, kind: str, zeros: bool) -> dict[str, Any]:
    """"ddp": every tensor held whole by every rank; "empty": a DTensor sharded over the ranks with no elements
    beside a replicated one (no rank writes a chunk of a sharded tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    value = (lambda n: torch.zeros(n)) if zeros else (lambda n: torch.arange(float(n)))
    state: dict[str, Any] = {"w": value(300 * 64).reshape(300, 64), "b": value(5)}
    if kind == "empty":
        state["none"] = distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)])
        state["w"] = distribute_tensor(state["w"], mesh, [Replicate()])
    return state


def save_odd(rank: int, world: int, path: str, kind: str) -> None:
    liferaft.save(path, _odd_state(world, kind, False), options=liferaft.SaveOptions(chunk_bytes=CHUNK))


def load_odd(rank: int, world: int, path: str, kind: str) -> bool:
    state = _odd_state(world, kind, True)
    liferaft.load(path, state)
    want = _odd_state(world, kind, False)
    w = state["w"].full_tensor() if kind == "empty" else state["w"]
    return torch.equal(w, want["w"].full_tensor() if kind == "empty" else want["w"]) and torch.equal(state["b"],
                                                                                                      want["b"])
