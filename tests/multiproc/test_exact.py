"""The test that matters most: a run that is killed and resumed equals an uninterrupted run, bit for bit.

A small GPT-style model (dropout on) trained with FSDP2 on 2 ranks, AdamW + StepLR, weighted data sources through
GlobalSampler, RNGState, CheckpointManager saving every 5 steps: run A trains 40 steps straight; run B is killed
(kill -9) right after the checkpoint of step 20 and a new job resumes and trains to 40. Every loss of steps
21..39 and the final parameters and AdamW moments are bitwise equal to run A.
"""

from __future__ import annotations

import pytest

from liferaft.testing import RankFailure, run_ranks
from multiproc._exact_ranks import resume, run_straight, run_until_crash


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
