"""Going back: restore(state, step=K) and training on from K, and a run that saves behind the root's newest step
(manager/rollback.py). Found by a hostile review: retention deleted the base of a save in flight and the new
run's own saves, a restart resumed on the abandoned steps, and an overwrite corrupted a newer committed step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import liferaft
from liferaft import CheckpointManager, SavePolicy
from liferaft.errors import CheckpointExistsError, OptionsError


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    base = torch.nn.Linear(256, 512)                # frozen: what incremental saves reference
    for p in base.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(512, 8)
    return {"base": base, "head": head, "optim": torch.optim.AdamW(head.parameters(), lr=1e-2), "step": 0}


def _train(s: dict, step: int) -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step))
    s["head"](s["base"](x)).pow(2).mean().backward()
    s["optim"].step()
    s["optim"].zero_grad()
    s["step"] = step + 1


def _first_run(root: str) -> None:
    s = _state()
    with CheckpointManager(root, every_steps=10, async_save=False, save_policy=SavePolicy(full_every=1)) as mgr:
        for step in range(31):
            _train(s, step)
            mgr.maybe_save(step, s)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rollback_goes_on_from_k_and_a_restart_resumes_the_new_run(tmp_path, async_save):
    root = str(tmp_path / "run")
    _first_run(root)                                            # steps 0 10 20 30, full saves
    s = _state(1)
    with CheckpointManager(root, every_steps=5, keep_last=2, async_save=async_save,
                           save_policy=SavePolicy(full_every=10)) as mgr:
        assert mgr.restore(s, step=10) == 10
        assert [i.step for i in mgr.steps()] == [0, 10, 20, 30]     # nothing removed before the run goes on
        for step in range(11, 26):
            _train(s, step)
            mgr.maybe_save(step, s)
        mgr.wait()
        listed = {i.step: i for i in mgr.steps()}
        assert all(i.status == "committed" for i in listed.values()), listed
        assert {20, 25} <= set(listed) and 30 not in listed          # the new run's saves kept, the old future gone
        assert listed[25].depends_on == (10,)                        # incremental on the restored step, kept
        expected = {k: v.clone() for k, v in s["head"].state_dict().items()}
    got = _state(2)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got) == 25
    assert all(torch.equal(got["head"].state_dict()[k], v) for k, v in expected.items())
    for i in liferaft.ls(root):
        liferaft.verify(i.path)


def test_redoing_a_step_never_corrupts_a_newer_one(tmp_path):
    """Step 2 references step 1's bytes; a run rolled back to 0 saves step 1 again (other data): step 2 is removed
    with the rest of the old future first, never left referencing files that are gone."""
    root = str(tmp_path / "run")
    m = torch.nn.Linear(512, 512)
    with CheckpointManager(root, every_steps=1, async_save=False, save_policy=SavePolicy(full_every=10)) as mgr:
        for step, (slow, fast) in enumerate([(0, 0.0), (1, 1.0), (1, 2.0)]):
            with torch.no_grad():
                m.weight.copy_(torch.randn(512, 512, generator=torch.Generator().manual_seed(slow)))
                m.bias.fill_(fast)
            mgr.maybe_save(step, {"m": m})
        assert [i.depends_on for i in mgr.steps()] == [(), (), (1,)]
    with CheckpointManager(root, every_steps=1, async_save=False) as mgr:
        mgr.restore({"m": m}, step=0)
        with torch.no_grad():
            m.weight.copy_(torch.randn(512, 512, generator=torch.Generator().manual_seed(7)))
        mgr.maybe_save(1, {"m": m})
        assert [(i.step, i.status) for i in mgr.steps()] == [(0, "committed"), (1, "committed")]
    got = torch.nn.Linear(512, 512)
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"m": got}) == 1
    assert torch.equal(got.weight, m.weight)


def test_a_pinned_step_after_k_stops_the_rollback_and_nothing_is_removed(tmp_path):
    root = str(tmp_path / "run")
    _first_run(root)
    with CheckpointManager(root, every_steps=5, async_save=False) as mgr:
        mgr.pin(30)
        s = _state(1)
        assert mgr.restore(s, step=10) == 10
        with pytest.raises(CheckpointExistsError, match=r"step\(s\) \[30\] are pinned"):
            mgr.maybe_save(11, s)
        assert [i.step for i in mgr.steps()] == [0, 10, 20, 30]
        with pytest.raises(CheckpointExistsError):           # still refused: the rollback was not carried out
            mgr.save(15, s)
        mgr.unpin(30)
        mgr.save(15, s)                                        # the rollback now goes through, then the save
        assert [i.step for i in mgr.steps()] == [0, 10, 15]


def test_saving_behind_the_roots_newest_step_without_a_rollback_is_refused(tmp_path):
    """A loop that starts at 0 on a root holding later steps (or ignores what restore returned) would overwrite
    what the newer steps reference: refused, naming both steps and the ways out; nothing changes."""
    root = str(tmp_path / "run")
    _first_run(root)
    s = _state(1)
    with CheckpointManager(root, every_steps=5, async_save=False) as mgr:
        with pytest.raises(CheckpointExistsError, match="saving step 5, but the root holds step 30"):
            mgr.maybe_save(5, s)
        assert mgr.restore(s) == 30
        mgr.save(30, s)                                        # the newest step again: allowed
        mgr.save(31, s)
        with pytest.raises(CheckpointExistsError, match="saving step 20"):
            mgr.save(20, s)
        assert [i.step for i in mgr.steps()] == [0, 10, 20, 30, 31]
    for i in liferaft.ls(root):
        liferaft.verify(i.path)


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True, float("nan"), 2**63, None])
def test_a_step_that_is_not_an_integer_in_range_is_an_options_error(tmp_path, bad):
    with CheckpointManager(str(tmp_path / "run"), every_steps=1, async_save=False) as mgr:
        for call in (lambda: mgr.maybe_save(bad, {"w": torch.ones(2)}, force=True),
                     lambda: mgr.save(bad, {"w": torch.ones(2)}), lambda: mgr.pin(bad), lambda: mgr.unpin(bad)):
            with pytest.raises(OptionsError, match="the step must be an integer"):
                call()
        if bad is not None:                                    # (None is restore's "the newest")
            with pytest.raises(OptionsError, match="the step must be an integer"):
                mgr.restore({"w": torch.ones(2)}, step=bad)
        assert mgr.steps() == []
        mgr.save(np.int64(3), {"w": torch.ones(2)})            # a numpy integer is a step
        assert [i.step for i in mgr.steps()] == [3]
