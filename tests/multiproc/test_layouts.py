"""DDP (replicated model) 2 ranks → 3 ranks, bitwise after the load; pipeline-style ownership (each rank holds
keys no other rank has) saved by 2 ranks, loaded per stage on 2 ranks and all stages in one process."""

from __future__ import annotations

import torch
from multiproc._layouts_ranks import ddp_load_continue, ddp_train_save, pipeline_load, pipeline_save, stage_of
from torch import nn

import liferaft
from liferaft.testing import run_ranks


def test_ddp_2_to_3_ranks_loads_bitwise_and_continues(tmp_path):
    """Params and SGD momentum equal those saved, bit for bit; the continuation agrees to float rounding (DDP
    averages gradients over 3 ranks instead of 2)."""
    path = str(tmp_path / "ck")
    reference = run_ranks(ddp_train_save, 2, path)
    saved, continued = reference[0]
    assert reference[1] == reference[0]
    for loaded, after in run_ranks(ddp_load_continue, 3, path):
        assert loaded == saved
        for k, v in continued.items():
            assert torch.allclose(torch.tensor(after[k]), torch.tensor(v), rtol=1e-5, atol=1e-7), k


def test_pipeline_stages_owned_by_one_rank_each(tmp_path):
    path = str(tmp_path / "ck")
    saved = run_ranks(pipeline_save, 2, path)
    assert run_ranks(pipeline_load, 2, path) == saved
    whole = {"stages": {"0": nn.Linear(8, 8), "1": nn.Linear(8, 8)}, "micro_batches": 0}
    liferaft.load(path, whole)                               # every stage into one process
    for r in range(2):
        assert torch.equal(whole["stages"][str(r)].weight, stage_of(r).weight)
    assert whole["micro_batches"] == 4


def test_tied_frozen_buffers_optimizer_scheduler_scaler_under_ddp_resume_bitwise(tmp_path):
    from multiproc._layouts_ranks import tied_ddp

    for opt_name in ("sgd-momentum", "adamw-fused"):
        path = str(tmp_path / opt_name)
        reference = run_ranks(tied_ddp, 2, path, "save", opt_name)
        assert run_ranks(tied_ddp, 2, path, "resume", opt_name) == reference
