"""liferaft.rebuild_stage (CheckFree): lost pipeline stages rebuilt from their neighbours on real ranks (gloo), one
stage per rank; the result checked against the weighted average computed here."""

from __future__ import annotations

import pytest
import torch
from multiproc._checkfree_ranks import mismatch, rebuild

from liferaft.testing import RankFailure, run_ranks


def _before(world: int) -> list[dict[str, torch.Tensor]]:
    """Every stage's tensors after its one training step, as the ranks computed them when nothing was lost."""
    return [_torch(o["tensors"]) for o in run_ranks(rebuild, world, [], "equal", timeout=120)]


def _torch(d: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in d.items()}


@pytest.mark.parametrize("weights", ["grad-norm", "equal"])
def test_a_middle_stage_is_the_weighted_average_of_its_neighbours(weights):
    before = _before(4)
    out = run_ranks(rebuild, 4, [2], weights, timeout=120)
    norms = [o["norm"] for o in out]
    w1, w3 = (norms[1], norms[3]) if weights == "grad-norm" else (1.0, 1.0)
    w1, w3 = w1 / (w1 + w3), w3 / (w1 + w3)
    got = _torch(out[2]["tensors"])
    for k, t in got.items():
        if t.is_floating_point():
            want = (before[1][k].double() * w1 + before[3][k].double() * w3).to(t.dtype)
            assert torch.equal(t, want), k
        else:
            assert torch.equal(t, before[1][k]), k              # integer buffers: the first neighbour's
    for r in (0, 1, 3):                                           # the live stages are untouched
        assert all(torch.equal(_torch(out[r]["tensors"])[k], before[r][k]) for k in before[r])
    report = out[0]["report"]
    assert all(o["report"] == report for o in out)
    assert report.rebuilt[0][:2] == (2, (1, 3)) and report.rebuilt[0][2] == pytest.approx((w1, w3))
    assert "stage 2 rebuilt from stage(s) 1, 3" in report.describe()
    assert out[2]["opt_state"] == 0                              # the lost stage's optimizer state cleared


def test_end_stages_and_two_lost_stages_copy_their_one_live_neighbour():
    before = _before(4)
    out = run_ranks(rebuild, 4, [0, 2], "grad-norm", timeout=120)
    assert {s: src for s, src, _ in out[0]["report"].rebuilt} == {0: (1,), 2: (1, 3)}
    assert all(torch.equal(_torch(out[0]["tensors"])[k], before[1][k]) for k in before[1])


def test_a_lost_stage_without_live_neighbours_or_of_other_shapes_is_refused_on_every_rank():
    with pytest.raises(RankFailure, match="no live neighbour") as e:
        run_ranks(rebuild, 3, [0, 1], "equal", timeout=120)
    assert str(e.value).count("InvalidStateError") >= 3
    with pytest.raises(RankFailure, match="do not hold the same tensors"):
        run_ranks(mismatch, 3, timeout=120)
