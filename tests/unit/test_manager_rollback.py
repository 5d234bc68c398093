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
        mgr._deleter.submit(lambda: None).result()   # (retention runs behind: a step it is deleting lists incomplete)
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


def test_a_damaged_newest_step_a_restore_skipped_is_never_ranked_the_newest(tmp_path):
    """restore(state) falls back past step 20, whose data is damaged (a shallow listing still calls it committed);
    training goes on under keep_last=1: retention must not keep 20 as the newest and delete the new run's 15 and
    its base (a restart then found nothing that loads). The damaged step stays for a person to look at."""
    import glob
    import os
    import warnings

    root = str(tmp_path / "run")
    st = lambda v: {"w": torch.full((256, 256), float(v))}
    with CheckpointManager(root, every_steps=10, async_save=False) as mgr:
        for n in range(21):
            mgr.maybe_save(n, st(n))                            # 0, 10, 20
    data = min(p for p in glob.glob(f"{root}/step-0000000020/**", recursive=True)
                  if os.path.isfile(p) and os.path.getsize(p) > 100_000)
    with open(data, "r+b") as f:                                # bit rot in step 20's data
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with CheckpointManager(root, every_steps=5, keep_last=1, async_save=False) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert mgr.restore(st(-1)) == 10
        mgr.maybe_save(15, st(15))
        mgr._deleter.submit(lambda: None).result()              # (the retention pass after the save has run)
        assert [i.step for i in mgr.steps()] == [15, 20]        # 15 the newest kept, the damaged 20 left alone
    got = st(-1)
    with CheckpointManager(root) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.restore(got) == 15
    assert torch.equal(got["w"], st(15)["w"])


def _logged_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _logged_step(st: dict, n: int, run: int) -> None:
    g = torch.Generator().manual_seed(n + 1000 * run)
    st["model"](torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    st["optim"].step()
    st["optim"].zero_grad()


def _logged_manager(tmp_path, shm: str, job: str) -> CheckpointManager:
    """A manager with the per-step log (full checkpoints only every 100 steps: the records carry the run)."""
    import os

    from liferaft import MemoryTier, StepLogOptions, TierOptions

    tier = MemoryTier(job, node="n0", base=os.path.join(shm, "tier"))
    return CheckpointManager(str(tmp_path / "root"), every_steps=100, async_save=False,
                             tiers=TierOptions(memory=tier, memory_every=10**6, drain=False),
                             step_log=StepLogOptions(replicas=1, max_steps=64))


def _logged_first_run(manager, data: int) -> dict:
    """Run 1: a full checkpoint at 0, then steps 1..20 in the per-step log (on data ``data``); its state."""
    st = _logged_state()
    with manager() as mgr:
        mgr.restore(st)
        for n in range(21):
            _logged_step(st, n, data)
            mgr.maybe_save(n, st)
    return st


def test_a_rollback_whose_first_call_is_save_drops_the_step_logs_newer_records(tmp_path, shm):
    """With the per-step log, records 1..20 of run 1 follow the full checkpoint 0; run 2 rolls back to 0, trains
    step 1 on other data and saves it with save() (not maybe_save): the old records go then, so a restart resumes
    run 2's step 1, never run 1's records replayed onto it."""
    state, step, manager = _logged_state, _logged_step, lambda: _logged_manager(tmp_path, shm, "rollback-unit")

    _logged_first_run(manager, 1)
    st = state()
    with manager() as mgr:
        assert mgr.restore(st, step=0) == 0
        step(st, 1, 2)
        mgr.save(1, st)
        want = {k: v.clone() for k, v in st["model"].state_dict().items()}
    got = state()
    with manager() as mgr:
        assert mgr.restore(got) == 1
    assert all(torch.equal(got["model"].state_dict()[k], v) for k, v in want.items())


def test_gc_from_the_command_line_never_keeps_an_abandoned_step_as_the_newest(tmp_path):
    """A rollback whose removal was interrupted (here: step 30 put back by hand, as a crash between recording the
    rollback and removing it leaves it) must not make `gc --keep-last 1` keep 30 and delete the live run."""
    import shutil

    root = str(tmp_path / "run")
    _first_run(root)                                            # 0 10 20 30, epoch 0
    shutil.copytree(f"{root}/step-0000000030", str(tmp_path / "s30"))
    s = _state(1)
    with CheckpointManager(root, every_steps=5, async_save=False, save_policy=SavePolicy(full_every=1)) as mgr:
        mgr.restore(s, step=10)
        mgr.save(15, s)                                         # epoch 1: 20 and 30 removed
    shutil.copytree(str(tmp_path / "s30"), f"{root}/step-0000000030")
    report = liferaft.gc(root, keep_last=1)
    assert 15 in report.kept and 30 in report.deleted
    with CheckpointManager(root) as mgr:
        assert mgr.restore(_state(2)) == 15


def test_a_rollback_recorded_but_not_carried_out_replays_no_abandoned_record(tmp_path, shm):
    """A crash after the rollback to 0 was recorded in BRANCHES, before run 1's per-step records were dropped (here:
    BRANCHES written by hand): the records say which epoch wrote them, and a restart replays none of run 1's."""
    from liferaft.manager.listing import write_branches

    state, manager = _logged_state, lambda: _logged_manager(tmp_path, shm, "rollback-unit2")

    st = _logged_first_run(manager, 0)
    want = {k: v.clone() for k, v in st["model"].state_dict().items()}
    got = state()
    with manager() as mgr:
        assert mgr.restore(got) == 20                           # (the records replay: run 1 as it was)
    assert all(torch.equal(got["model"].state_dict()[k], v) for k, v in want.items())
    write_branches(liferaft.storage.resolve(str(tmp_path / "root")), [(1, 0)])
    with manager() as mgr:
        assert mgr.restore(state()) == 0


def test_a_users_epoch_in_the_metadata_is_kept_and_never_read_as_a_rollback(tmp_path):
    root = str(tmp_path / "run")
    s = _state()
    opts = liferaft.SaveOptions(metadata={"epoch": 7})
    with CheckpointManager(root, every_steps=1, async_save=False, save_options=opts) as mgr:
        for step in range(3):
            mgr.maybe_save(step, s)
        mgr.restore(s, step=1)
        mgr.save(2, s)
    meta = liferaft.inspect(f"{root}/step-0000000002").metadata
    assert meta["epoch"] == 7 and meta["liferaft_rollbacks"] == 1
    with CheckpointManager(root, save_options=opts) as mgr:
        assert mgr.restore(_state()) == 2


def test_retention_after_a_rollback_spares_nothing_of_the_new_run(tmp_path):
    """An explicit restore(step=K) skips no damaged step: the new run's steps that reuse the old run's numbers are
    ranked and deleted by keep_last like any other."""
    root = str(tmp_path / "run")
    with CheckpointManager(root, every_steps=1, async_save=False, save_policy=SavePolicy(full_every=1)) as mgr:
        for step in range(6):
            mgr.maybe_save(step, {"w": torch.full((64,), float(step))})
    with CheckpointManager(root, every_steps=1, keep_last=2, async_save=False,
                           save_policy=SavePolicy(full_every=1)) as mgr:
        mgr.restore({"w": torch.zeros(64)}, step=1)
        for step in range(2, 12):
            mgr.maybe_save(step, {"w": torch.full((64,), 100.0 + step)})
        mgr.wait()
        mgr._deleter.submit(lambda: None).result()
        assert [i.step for i in mgr.steps()] == [10, 11]
