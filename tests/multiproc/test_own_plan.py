"""Saves each rank plans on its own from compact layouts (DTensors over a mesh of the ranks, plain tensors held
whole; ``planning.layouts``), on 4 real ranks: the path is taken, the checkpoint holds exactly the state (loaded
whole in one process and resharded onto 3 ranks; DTensors on sub-meshes included), a plan reused from the cache saves the same, a layout the
ranks do not agree on falls back to the gathered plan, and a failure on one rank fails the save on all."""

from __future__ import annotations

import pytest
import torch
from multiproc._own_plan_ranks import DTENSORS, SUB, fail_on, full, save

import liferaft
from liferaft.testing import run_ranks


def _manifest(path: str):
    from liferaft.core.commit import open_checkpoint
    from liferaft.storage import resolve

    return open_checkpoint(resolve(path))


def _whole(path: str) -> dict:
    state = {name: torch.zeros(shape) for name, (shape, *_) in [*DTENSORS.items(), *SUB.items()]}
    state.update(plain=torch.zeros(6, 7), step=0, vocab={})
    liferaft.load(path, state, options=liferaft.LoadOptions(ignore_keys=("rank", "seen")))
    return state


def _load_rows(rank: int, world: int, path: str) -> dict:
    """Each of ``world`` ranks loads a row block of every tensor (a resharding load)."""
    out = {}
    for name, (shape, _) in DTENSORS.items():
        lo, hi = rank * shape[0] // world, (rank + 1) * shape[0] // world
        t = torch.zeros((hi - lo,) + shape[1:])
        out[name] = liferaft.Sharded(t, shape, (lo,) + (0,) * (len(shape) - 1))
    liferaft.load(path, out, options=liferaft.LoadOptions(ignore_keys=("rank", "step", "plain", "vocab", "seen",
                                                                       *SUB)))
    return {k: v.local.tolist() for k, v in out.items()}


def test_each_rank_plans_its_own_writes_and_the_checkpoint_is_exact(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_ranks(save, 4, a, False, b)
    for kinds, total, files in results:
        assert kinds == ["layouts", "layouts"]           # the second save reused the cached plan
    assert len({(t, f) for _, t, f in results}) == 1        # every rank reports the same totals
    for path in (a, b):
        state = _whole(path)
        for name in [*DTENSORS, *SUB]:
            assert torch.equal(state[name], full(name)), name
        assert torch.equal(state["plain"], full("plain"))
        assert state["step"] == 7
        m = _manifest(path)
        assert next(v for v in m.values if v.key == "rank").per_rank == (0, 1, 2, 3)
        vocab = next(v for v in m.values if v.key == "vocab")
        assert vocab.per_rank is None and state["vocab"] == {"words": [f"w{i}" for i in range(2000)]}
        assert len(next(v for v in m.values if v.key == "seen").per_rank) == 4
        for t in m.tensors:                                  # every element stored exactly once
            assert sum(c.length for c in t.chunks) == torch.Size(t.shape).numel() * 4, t.key
    for rank, got in enumerate(run_ranks(_load_rows, 3, a)):
        for name, (shape, _) in DTENSORS.items():
            lo, hi = rank * shape[0] // 3, (rank + 1) * shape[0] // 3
            assert got[name] == full(name)[lo:hi].tolist(), name


def test_plain_tensors_that_differ_fall_back_to_the_gathered_plan(tmp_path):
    path = str(tmp_path / "ck")
    for kinds, _, _ in run_ranks(save, 4, path, True):
        assert kinds == ["gathered"]
    m = _manifest(path)
    assert next(t for t in m.tensors if t.key == "plain").per_rank == (0, 1, 2, 3)


@pytest.mark.parametrize("bad_rank", [0, 3])
def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path, bad_rank):
    path = str(tmp_path / "ck")
    outcomes = run_ranks(fail_on, 4, path, bad_rank)
    assert all(o != "saved" for o in outcomes)
    with pytest.raises(liferaft.LiferaftError):
        _manifest(path)
