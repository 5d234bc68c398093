"""The test that matters most: a run that is killed and resumed equals an uninterrupted run, bit for bit.

A small GPT-style model (dropout on) trained with FSDP2 on 2 ranks, AdamW + StepLR, weighted data sources through
GlobalSampler, RNGState, CheckpointManager saving every 5 steps: run A trains 40 steps straight; run B is killed
(kill -9) right after the checkpoint of step 20 and a new job resumes and trains to 40. Every loss of steps
21..39 and the final parameters and AdamW moments are bitwise equal to run A.
"""

from __future__ import annotations

import pytest
from multiproc._exact_ranks import (
    load_on_new_layout,
    resume,
    run_straight,
    run_straight_no_dropout,
    run_until_crash,
    save_then_crash,
)

from liferaft.testing import RankFailure, run_ranks


def test_kill_and_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    root = str(tmp_path / "run")
    straight = run_ranks(run_straight, 2, 40, timeout=300)
    with pytest.raises(RankFailure):
        run_ranks(run_until_crash, 2, root, 40, 20, timeout=300)
    resumed = run_ranks(resume, 2, root, 40, timeout=300)
    for rank in range(2):
        losses_a, params_a = straight[rank]
        last, losses_b, params_b = resumed[rank]
        assert last == 20
        assert losses_b == losses_a[21:], (losses_a[21:], losses_b)
        assert params_b == params_a


@pytest.mark.parametrize("world,tp", [(1, 1), (4, 1), (4, 2)],
                         ids=["1 rank", "4 ranks", "FSDP2 2 x TP 2"])
def test_resume_on_another_layout_loads_bitwise_and_the_loss_continues(tmp_path, world, tp):
    """2 ranks FSDP2 → 1 rank, 4 ranks, or FSDP2 + TP on a 2 × 2 mesh (dropout off: a new layout gets new RNG streams): params and AdamW state
    right after the load equal those saved, bit for bit, and the loss curve continues (the data order is the same
    global order; only the reduction order of the gradients differs)."""
    root = str(tmp_path / "ck")
    reference = run_ranks(run_straight_no_dropout, 2, 16, timeout=300)[0]
    saved = run_ranks(save_then_crash, 2, root, 10, timeout=300)
    out = run_ranks(load_on_new_layout, world, root, 10, 6, tp, timeout=300)
    for after, losses in out:
        assert after == saved[0][1]
        assert losses == pytest.approx(reference[10:16], rel=1e-4)
