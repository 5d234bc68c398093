"""Rank functions for the 2-rank bad-input tests (imported by child processes as ``multiproc._bad_input_ranks``).

Each function catches the error it expects and returns ``(error type name, message, state unchanged?)`` so that
``run_ranks`` reports every rank's outcome instead of raising RankFailure.
"""

from __future__ import annotations

import copy
import errno
from typing import Any

import torch

import liferaft
from liferaft import LiferaftError, LoadOptions, SaveOptions, Sharded
from liferaft.storage import PosixStorage, register_scheme

TIMEOUT = 60.0


class Custom:
    """A user object that plain-data encoding cannot store."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and other.x == self.x


def reference() -> dict:
    """The committed checkpoint the tests start from (saved by one process)."""
    return {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4), "step": 7}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Sharded):
        return isinstance(b, Sharded) and a.offsets == b.offsets and _same(a.local, b.local)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _outcome(fn, state: Any) -> tuple[str, str, bool]:
    before = copy.deepcopy(state)
    try:
        fn()
    except LiferaftError as e:
        return type(e).__name__, str(e), _same(state, before)
    except OSError as e:
        return type(e).__name__, str(e), _same(state, before)
    return "no error", "", _same(state, before)


# ---------------------------------------------------------------------------------------------------- load


def load_rank1_wrong_shape(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    """Rank 1's state holds ``w`` with the wrong shape."""
    shape = (4, 4) if rank == 0 else (4, 3)
    state = {"w": torch.full(shape, -1.0), "step": -1}
    return _outcome(lambda: liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT)), state)


def load_sharded_rank1_corrupt(rank: int, world: int, path: str, atomic: bool) -> tuple[str, str, bool]:
    """Each rank loads its half of ``w``; the parent corrupted the bytes of rows 2..3 only (rank 1's half)."""
    state = {"w": Sharded(torch.full((2, 4), -1.0), (4, 4), (2 * rank, 0)), "step": -1}
    opts = LoadOptions(timeout=TIMEOUT, atomic=True) if atomic else LoadOptions(timeout=TIMEOUT)
    return _outcome(lambda: liferaft.load(path, state, options=opts), state)


def load_codec_known_to_rank0_only(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    """The manifest names codec ``x-rank0-only``, which only rank 0 registered: every rank decodes the manifest
    itself, so rank 1 refuses it while rank 0 would go on."""
    if rank == 0:
        from liferaft.codecs.bytegroup import ByteGroupZstd
        from liferaft.codecs.registry import register

        class RankZeroOnly(ByteGroupZstd):
            name = "x-rank0-only"
        register(RankZeroOnly())
    state = {"w": torch.full((64, 64), -1.0), "step": -1}
    return _outcome(lambda: liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT)), state)


# ---------------------------------------------------------------------------------------------------- save


def _save(path: str, state: Any) -> None:
    liferaft.save(path, state, options=SaveOptions(overwrite=True, timeout=TIMEOUT))


def save_rank1_custom_object(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    """Rank 1 holds a value that needs pickle (not allowed)."""
    state = {"w": Sharded(torch.ones(2, 4) * (rank + 1), (4, 4), (2 * rank, 0)),
             "step": 8, "obj": Custom(1) if rank == 1 else 1}
    return _outcome(lambda: _save(path, state), state)


def save_overlapping_shards(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    """Rank 0 holds rows 0..2 and rank 1 rows 1..3 of a 4-row tensor: rows 1-2 overlap."""
    state = {"w": Sharded(torch.ones(3, 4), (4, 4), (rank, 0)), "step": 8}
    return _outcome(lambda: _save(path, state), state)


def save_different_global_shapes(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    """Both ranks hold 2 rows of ``w``, but rank 1 says the global tensor has 5 rows, rank 0 says 4."""
    state = {"w": Sharded(torch.ones(2, 4), (4, 4) if rank == 0 else (5, 4), (2 * rank, 0)), "step": 8}
    return _outcome(lambda: _save(path, state), state)


class _Rank1WriteFails(PosixStorage):
    """Rank 1 cannot create its data file (disk full) after rank 0 may already have written its own."""

    def open_writer(self, name: str):
        import torch.distributed as dist

        if name.startswith("data/") and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, f"injected: no space left for {name}")
        return super().open_writer(name)


def save_rank1_write_fails(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    register_scheme("lrtest-rank1-nospace", _Rank1WriteFails)
    state = {"w": Sharded(torch.ones(2, 4) * 5, (4, 4), (2 * rank, 0)), "step": 9}
    return _outcome(lambda: _save(f"lrtest-rank1-nospace://{path}", state), state)
