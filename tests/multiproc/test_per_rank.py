"""Plain values that look replicated but differ between ranks are stored per rank, never one rank's copy for all
(issue 14, item 4). PyTorch DCP keeps one copy of such a tensor (it deduplicates by key) and every rank loads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from multiproc._per_rank_ranks import change_then_save, load, load_other_world, save, state_of

import liferaft
from liferaft.testing import run_ranks


def expected(rank: int) -> dict:
    s = state_of(rank)
    return {"mine": s["mine"].tolist(), "counter": s["counter"].tolist(), "same": s["same"].tolist(),
            "big_np": s["big_np"].tolist(), "big_bytes": s["big_bytes"], "nested.t": s["nested"]["t"].tolist(),
            "nested.step": 7}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_plain_values_that_differ_per_rank_come_back_to_their_rank(tmp_path, asynchronous):
    path = str(tmp_path / "ck")
    run_ranks(save, 2, path, asynchronous)
    for p in [path] + ([path + "-again"] if asynchronous else []):
        assert run_ranks(load, 2, p) == [expected(0), expected(1)]
    info = liferaft.inspect(path)
    assert info.format_version == 4         # (each rank wrote its own copies' rows: explicit boxes, chunk tables)
    shapes = {t.key: t.shape for t in info.tensors}
    assert shapes["mine"] == (2, 5056) and shapes["counter"] == (2,) and shapes["big_np"] == (2, 20_000)
    assert shapes["same"] == (6,)                                   # equal copies: stored once, as before
    tree = liferaft.read(path)
    assert isinstance(tree["mine"], liferaft.PerRank) and [t.tolist() for t in tree["mine"]] == \
        [state_of(r)["mine"].tolist() for r in range(2)]
    assert [a.tolist() for a in tree["big_np"]] == [np.full(20_000, r, np.float32).tolist() for r in range(2)]
    assert list(tree["big_bytes"]) == [bytes([r]) * 70_000 for r in range(2)]
    assert torch.equal(tree["same"], torch.arange(6.0))
    liferaft.verify(path)


def test_another_world_size_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(save, 2, path, False)
    errors = run_ranks(load_other_world, 3, path)
    assert all("held a different value on each of the 2 saving ranks" in e for e in errors)
    assert all("'mine'" in e or "'counter'" in e or "'big_np'" in e or "'big_bytes'" in e or "'nested.t'" in e
               for e in errors)
    with pytest.raises(liferaft.StateMismatchError, match="cannot be mapped onto 1 ranks"):
        liferaft.load(path, {"mine": torch.zeros(5056, dtype=torch.uint8), "same": torch.zeros(6)})
    # strict=False: what can be mapped is loaded; the per-rank key is left as it is and listed as missing
    live = {"mine": torch.zeros(5056, dtype=torch.uint8), "same": torch.zeros(6)}
    res = liferaft.load(path, live, strict=False)
    assert "mine" in res.missing_keys and torch.equal(live["mine"], torch.zeros(5056, dtype=torch.uint8))
    assert torch.equal(live["same"], torch.arange(6.0))


def test_the_plan_follows_when_copies_start_or_stop_differing(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(change_then_save, 2, path)
    shapes = [{t.key: t.shape for t in liferaft.inspect(f"{path}-{i}").tensors}["mine"] for i in range(3)]
    assert shapes == [(5056,), (2, 5056), (5056,)]
    assert [t.tolist() for t in liferaft.read(f"{path}-1")["mine"]] == \
        [(torch.arange(5056, dtype=torch.uint8) + r).tolist() for r in range(2)]


def test_a_plain_value_some_saving_ranks_did_not_hold_is_missing_there_never_none(tmp_path):
    from multiproc._per_rank_ranks import load_held_by_some, save_held_by_some

    path = str(tmp_path / "ck")
    run_ranks(save_held_by_some, 2, path)
    assert liferaft.read(path)["only0"] == (11, None)
    # rank 1 held no only0: missing (the result lists every rank's), never set to None; none_or_one's None is rank 1's
    assert run_ranks(load_held_by_some, 2, path, False) == [(11, 1, ("only0",)), (-1, None, ("only0",))]
    assert run_ranks(load_held_by_some, 2, path, True)[1] == ("refused", True)
