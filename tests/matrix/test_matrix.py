"""Every path with the same assertions (DESIGN principle 8), as torchsnapshot's toggles: save path (sync, async) ×
compression (off, on) × storage backend (a posix folder, ``memory://``, S3 on a moto server).

- Round trip: a model + optimizer + plain values state saved and loaded into fresh objects, bit for bit.
- Reshard: 2 real gloo ranks save DTensors (Shard(0)); 3 ranks load them as Shard(1), 1 process loads them whole
  and as 3 hand-made ``Sharded`` boxes. The multi-rank part is two process starts for all cells (one save
  launch, one load launch), shared by the cell tests through a module fixture. ``memory://`` is process-local
  (a save from 2 ranks is refused), so its cells save from this process and do the 1- and 3-box loads here.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compare import assert_same
from matrix._matrix_ranks import CELLS, PIECES_LAYOUT, Cell, load_cells, save, save_cells, wrong_names
from multiproc._reshard_ranks import SHAPES, build_state, reference
from torch import nn

import liferaft
from liferaft.testing import run_ranks

IDS = [c.id for c in CELLS]


@pytest.fixture
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh place on the cell's backend under which the test makes its checkpoints."""
    cell: Cell = request.param
    if cell.backend == "posix":
        yield str(tmp_path)
    elif cell.backend == "s3":
        yield request.getfixturevalue("s3_prefix")
    else:
        from liferaft.storage.memory import drop_memory_store

        name = f"matrix-{uuid.uuid4().hex[:12]}"
        yield f"memory://{name}"
        drop_memory_store(name)


def _training_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return {"model": model, "optim": optim, "step": 0, "values": {"name": "run", "lrs": [0.0], "seen": None},
            "zeros": torch.zeros(1 << 15)}


def _train(state: dict[str, Any], steps: int) -> None:
    for i in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i))
        state["model"](x).pow(2).mean().backward()
        state["optim"].step()
        state["optim"].zero_grad()
    state["step"] += steps
    state["values"] = {"name": "run-7", "lrs": [1e-2, 3e-3], "seen": np.arange(6, dtype=np.int32),
                       "nested": {"ok": True, "t": (1, "two", 3.5)}}
    state["zeros"][::7] = 1.0


@pytest.mark.parametrize("root", CELLS, ids=IDS, indirect=True)
def test_round_trip(root: str, request: pytest.FixtureRequest) -> None:
    cell: Cell = request.node.callspec.params["root"]
    state = _training_state(seed=0)
    _train(state, 3)
    path = f"{root}/ck"
    res = save(path, state, cell)
    assert (res.bytes_encoded > 0) == (cell.compression == "on"), res
    liferaft.verify(path)

    fresh = _training_state(seed=1)
    fresh["values"] = {"name": None, "lrs": None, "seen": None, "nested": None}
    liferaft.load(path, fresh)
    assert fresh["step"] == 3
    assert_same(fresh["values"], state["values"])
    assert_same(fresh["model"].state_dict(), state["model"].state_dict())
    assert_same(fresh["optim"].state_dict(), state["optim"].state_dict())
    assert torch.equal(fresh["zeros"], state["zeros"])
    # and training goes on identically from both
    twin = copy.deepcopy(state)
    _train(fresh, 2)
    _train(twin, 2)
    assert_same(fresh["model"].state_dict(), twin["model"].state_dict())

    tree = liferaft.read(path)
    assert torch.equal(tree["model"]["0.weight"], state["model"][0].weight.detach())


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The multi-rank part of every cell in two launches: save on 2 ranks (a ``memory://`` cell's save is expected
    to be refused), load on 3 (posix and s3 cells). Per cell: its path and, per launch, each rank's (ok, result or
    traceback)."""
    env: dict[str, str] = {}
    s3_root = ""
    if any(c.backend == "s3" for c in CELLS):
        server = request.getfixturevalue("s3_server")
        env = server.env()
        s3_root = f"s3://{server.bucket}/reshard-{uuid.uuid4().hex[:8]}"
    folder = tmp_path_factory.mktemp("reshard")
    where = {"s3": lambda c: f"{s3_root}/{c.id}", "memory": lambda c: f"memory://reshard-{uuid.uuid4().hex[:8]}",
             "posix": lambda c: str(folder / c.id)}
    paths = [(c, where[c.backend](c)) for c in CELLS]
    saved = run_ranks(save_cells, 2, paths, env=env, timeout=300)
    shared = [(c, p) for c, p in paths if c.backend != "memory"]
    loaded = run_ranks(load_cells, 3, shared, env=env, timeout=300)
    return {"env": env, **{c.id: {"path": p, "saved": [r[c.id] for r in saved],
                                  "loaded": [r.get(c.id) for r in loaded]} for c, p in paths}}


def _check_ranks(what: str, results: list[tuple[bool, Any]]) -> list[Any]:
    for rank, (ok, value) in enumerate(results):
        assert ok, f"{what}, rank {rank} failed:\n{value}"
    return [value for _, value in results]


def _load_here(path: str) -> None:
    """Load the reference state whole (1 process) and as 3 ``Sharded`` boxes, one after another in this process."""
    whole = build_state(0, 1, {"kind": "plain"}, "zero")
    liferaft.load(path, whole)
    assert wrong_names(whole) == []
    for piece in range(3):
        boxes = build_state(piece, 3, PIECES_LAYOUT, "zero")
        liferaft.load(path, boxes)
        assert wrong_names(boxes) == [], f"box {piece}"
    tree = liferaft.read(path)
    for name in SHAPES:
        assert torch.equal(tree[name], reference(name)), name


@pytest.mark.parametrize("cell", CELLS, ids=IDS)
def test_reshard(cell: Cell, ranked: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    mine = ranked[cell.id]
    if cell.backend == "memory":
        for rank, (ok, value) in enumerate(mine["saved"]):
            assert not ok and "StorageError" in value and "process-local" in value, f"rank {rank}: {value}"
        path = f"memory://matrix-{uuid.uuid4().hex[:12]}"
        try:
            res = save(f"{path}/ck", build_state(0, 1, {"kind": "plain"}, "ref"), cell)
            assert (res.bytes_encoded > 0) == (cell.compression == "on"), res
            _load_here(f"{path}/ck")
        finally:
            from liferaft.storage.memory import drop_memory_store

            drop_memory_store(path.removeprefix("memory://"))
        return
    for k, v in ranked["env"].items():
        monkeypatch.setenv(k, v)
    encoded = _check_ranks(f"{cell.id}: 2-rank save", mine["saved"])
    assert (sum(encoded) > 0) == (cell.compression == "on"), encoded
    wrong = _check_ranks(f"{cell.id}: 3-rank load", mine["loaded"])
    assert wrong == [[]] * 3, f"{cell.id}: 3-rank load, wrong values per rank: {wrong}"
    info = liferaft.inspect(mine["path"])
    assert info.world_size == 2 and {t.key: t.chunks for t in info.tensors}["a"] == 2
    liferaft.verify(mine["path"])
    _load_here(mine["path"])
