"""CheckpointManager.mark_lossy: a state rebuilt by CheckFree is recorded as lossy in every later save, and a restore
of such a step keeps saying so."""

from __future__ import annotations

import torch

import liferaft


def test_a_lossy_state_is_recorded_and_restored(tmp_path):
    root = str(tmp_path / "run")
    state = {"w": torch.ones(4)}
    with liferaft.CheckpointManager(root, async_save=False) as mgr:
        mgr.maybe_save(0, state, force=True)
        assert mgr.lossy_state is None
        mgr.mark_lossy("stage 2 rebuilt from stage(s) 1, 3 (weights 0.600, 0.400)")
        mgr.maybe_save(1, state, force=True)
    info = liferaft.inspect(f"{root}/step-0000000001")
    assert "stage 2 rebuilt" in str(info.metadata.get("lossy_state")), info.metadata
    assert "lossy_state" not in liferaft.inspect(f"{root}/step-0000000000").metadata
    with liferaft.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(state) == 1
        assert mgr.lossy_state is not None and "stage 2 rebuilt" in mgr.lossy_state
        mgr.mark_lossy("stage 0 rebuilt")                         # a second rebuild adds to it
        assert mgr.lossy_state.endswith("; stage 0 rebuilt")
    with liferaft.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(state, step=0) == 0 and mgr.lossy_state is None    # step 0 was saved before it
