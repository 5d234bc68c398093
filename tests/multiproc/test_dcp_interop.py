"""DCP checkpoints written by 2 ranks (one chunk per rank) read by liferaft in other layouts and converted in one
process; liferaft's DCP export of a 2-rank save read by DCP's own loader on 2 ranks."""

from __future__ import annotations

import torch
from multiproc._dcp_ranks import dcp_load_export, dcp_save_sharded, full, liferaft_save_sharded, load_dcp_other_layout

import liferaft
from liferaft.testing import run_ranks


def test_dcp_from_two_ranks_loads_in_other_layouts_and_converts(tmp_path):
    dcp_path = str(tmp_path / "dcp")
    run_ranks(dcp_save_sharded, 2, dcp_path)
    w = liferaft.describe(dcp_path, ["model.w"], stats=True)[0]   # inspect a DCP folder: how it was sharded
    assert (w.layout, w.ranks, w.chunks) == ("dim 0 in 2 (cut at 6)", (0, 1), 2)
    assert abs(w.stats["mean"] - float(full("w").mean())) < 1e-6
    assert run_ranks(load_dcp_other_layout, 2, dcp_path) == [[True] * 6] * 2
    one = {"model": {"w": torch.zeros(12, 10), "h": torch.zeros(9, 4, dtype=torch.bfloat16)}, "b": torch.zeros(7),
           "step": 0, "sched": {"last_epoch": 0, "lrs": []}}
    liferaft.load(dcp_path, one)                               # 2 ranks' chunks into one process
    assert torch.equal(one["model"]["w"], full("w")) and torch.equal(one["model"]["h"], full("h"))

    back = str(tmp_path / "back")
    report = liferaft.convert(dcp_path, back, "liferaft")      # chunks kept as boxes (a Sharded with two boxes)
    assert report.tensors == 3
    info = {t.key: t for t in liferaft.inspect(back).tensors}
    assert info["model.w"].chunks == 2
    tree = liferaft.read(back)
    assert torch.equal(tree["model"]["w"], full("w")) and torch.equal(tree["b"], full("b"))
    assert tree["step"] == 11 and tree["sched"] == {"last_epoch": 3, "lrs": [0.1, 0.01]}


def test_liferaft_export_of_a_two_rank_save_loads_with_dcp_on_two_ranks(tmp_path):
    src, dst = str(tmp_path / "ck"), str(tmp_path / "dcp")
    run_ranks(liferaft_save_sharded, 2, src)
    w = liferaft.describe(src, ["model.w"])[0]                  # inspect shows the sharding as saved
    assert (w.layout, w.ranks) == ("dim 1 in 2 (cut at 5)", (0, 1))
    liferaft.convert(src, dst, "dcp")
    assert run_ranks(dcp_load_export, 2, dst) == [[True] * 4] * 2


def test_a_dcp_load_raises_on_every_rank_when_one_rank_fails(tmp_path):
    """The DCP path of load used to skip the all-ranks error exchange (and report rank 0 everywhere): a shape
    mismatch on rank 1 left rank 0 loaded and waiting. Now one pipeline: every rank raises before anything moves."""
    from multiproc._dcp_ranks import load_dcp_one_rank_wrong

    dcp_path = str(tmp_path / "dcp")
    run_ranks(dcp_save_sharded, 2, dcp_path)
    assert run_ranks(load_dcp_one_rank_wrong, 2, dcp_path) == [("DistributedError", 0), ("StateMismatchError", 1)]
