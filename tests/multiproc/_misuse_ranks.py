"""Rank functions of tests/multiproc/test_misuse_ranks.py: a load whose destination on one rank cannot be written
in place (imported by child processes as ``multiproc._misuse_ranks``)."""

from __future__ import annotations

import torch

import liferaft
from liferaft import LiferaftError, LoadOptions

TIMEOUT = 60.0


def load_rank1_unwritable(rank: int, world: int, path: str, kind: str) -> tuple[str, str, bool]:
    """Rank 1's "w" is an expanded (stride-0) view or an overlapping as_strided; rank 0's is fine. Returns (error
    type, message, every tensor of this rank's state bitwise unchanged)."""
    w = torch.zeros(4, 4)
    if rank == 1:
        w = torch.zeros(1, 4).expand(4, 4) if kind == "expand" else torch.zeros(10).as_strided((4, 4), (2, 1))
    state = {"a": torch.zeros(4), "w": w, "z": torch.zeros(3)}
    before = {k: v.clone() for k, v in state.items()}
    try:
        liferaft.load(path, state, options=LoadOptions(timeout=TIMEOUT))
    except LiferaftError as e:
        return type(e).__name__, str(e), all(torch.equal(state[k], before[k]) for k in state)
    return "no error", "", all(torch.equal(state[k], before[k]) for k in state)


def load_with_strict_on_rank0_then_again(rank: int, world: int, path: str) -> list:
    """A load with strict=(rank == 0) (misuse: the options differ between ranks), then a correct one."""
    import liferaft as lf

    out = []
    for state, strict in (({"x": torch.zeros(6)}, rank == 0), ({"x": torch.zeros(6), "y": torch.zeros(4)}, True)):
        try:
            lf.load(path, state, strict=strict, options=lf.LoadOptions(timeout=30))
            out.append(("ok", state["x"].tolist()))
        except lf.errors.LiferaftError as e:
            out.append((type(e).__name__, str(e)[:200]))
    return out


def load_with_ignore_keys_in_rank_order(rank: int, world: int, path: str) -> str:
    """The same ignore_keys in another order on each rank (a tuple made from a set): the same options."""
    import liferaft as lf

    keys = ("y", "z") if rank == 0 else ("z", "y")
    state = {"x": torch.zeros(6)}
    lf.load(path, state, options=lf.LoadOptions(ignore_keys=keys, share_reads=rank == 0, timeout=30))
    return "ok"
