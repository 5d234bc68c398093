"""The toggles of the test matrix (save path × compression × storage backend) and the rank functions of its
resharding half (imported by child processes as ``matrix._matrix_ranks``).

A rank function runs every cell it is given in one process start and returns, per cell, either its result or the
traceback of its failure, so one launch serves all cells and each cell is still reported on its own."""

from __future__ import annotations

import itertools
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from multiproc._reshard_ranks import SHAPES, build_state, local_equals_reference

import liferaft

MODES = ("sync", "async")
COMPRESSION = ("off", "on")
BACKENDS = ("posix", "memory", "s3")
TIMEOUT = 60.0          # seconds a rank waits for the others at a step (a broken cell fails, never hangs)

SAVE_LAYOUT = {"kind": "dtensor", "mesh": (2,), "placements": ["S0"]}       # 2 ranks: Shard(0)
LOAD_LAYOUT = {"kind": "dtensor", "mesh": (3,), "placements": ["S1"]}       # 3 ranks: Shard(1), uneven
PIECES_LAYOUT = {"kind": "sharded", "parts": 3}                             # 3 hand-made boxes along dim 0


@dataclass(frozen=True)
class Cell:
    """One combination of the toggles."""

    mode: str
    compression: str
    backend: str

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.compression}-{self.backend}"


CELLS = tuple(Cell(m, c, b) for b, m, c in itertools.product(BACKENDS, MODES, COMPRESSION))


def save(path: str, state: Any, cell: Cell, **opts: Any) -> liferaft.SaveResult:
    """Save ``state`` the way ``cell`` says and return once it is committed."""
    options = liferaft.SaveOptions(compression=cell.compression, timeout=TIMEOUT, **opts)
    if cell.mode == "sync":
        return liferaft.save(path, state, options=options)
    handle = liferaft.async_save(path, state, options=options)
    return handle.wait()


def _each(cells: list[tuple[Cell, str]], fn: Any) -> dict[str, tuple[bool, Any]]:
    out: dict[str, tuple[bool, Any]] = {}
    for cell, path in cells:
        try:
            out[cell.id] = (True, fn(cell, path))
        except Exception:  # noqa: BLE001 - reported per cell to the test
            out[cell.id] = (False, traceback.format_exc())
    return out


def save_cells(rank: int, world: int, cells: list[tuple[Cell, str]]) -> dict[str, tuple[bool, Any]]:
    """Every cell: save the reference values as DTensors of ``SAVE_LAYOUT``; result: this rank's encoded bytes."""
    def one(cell: Cell, path: str) -> int:
        return save(path, build_state(rank, world, SAVE_LAYOUT, "ref"), cell).bytes_encoded

    return _each(cells, one)


def load_cells(rank: int, world: int, cells: list[tuple[Cell, str]]) -> dict[str, tuple[bool, Any]]:
    """Every cell: load into ``LOAD_LAYOUT`` DTensors; result: the names whose local shard is not the reference."""
    def one(cell: Cell, path: str) -> list[str]:
        state = build_state(rank, world, LOAD_LAYOUT, "zero")
        liferaft.load(path, state, options=liferaft.LoadOptions(timeout=TIMEOUT))
        return wrong_names(state)

    return _each(cells, one)


def wrong_names(state: dict[str, Any]) -> list[str]:
    """Names of ``state`` (as ``build_state`` makes it) that do not hold the reference values."""
    from multiproc._reshard_ranks import reference

    wrong = [n for n in SHAPES if not local_equals_reference(n, state[n])]
    if not torch.equal(state["rep"], reference("a")):
        wrong.append("rep")
    if state["meta"] != {"step": 12, "name": "run"}:
        wrong.append("meta")
    return wrong
