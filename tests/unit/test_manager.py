"""CheckpointManager in one process: policies, retention, restore with fallback, leftovers, lease, preemption."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
import torch

import liferaft
from liferaft import (
    CheckpointBusyError,
    CheckpointManager,
    CheckpointNotFoundError,
    JobOptions,
    OptionsError,
    PreemptionOptions,
    RetentionPolicy,
    SavePolicy,
)
from liferaft.storage import register_scheme
from liferaft.testing.faults import FailingStorage

# ---------------------------------------------------------------------------------------------- pure policies


def test_save_policy_combines_with_or_and_never_saves_a_step_twice():
    p = SavePolicy(every_steps=10, at_steps=frozenset({7}), last_step=25, every_seconds=60.0)
    assert p.due(10, 0.0, None, 0.0) == "every_steps"
    assert p.due(7, 0.0, None, 0.0) == "at_steps"
    assert p.due(25, 0.0, None, 0.0) == "last_step"
    assert p.due(11, 30.0, 10, 0.0) is None
    assert p.due(11, 61.0, 10, 0.0) == "every_seconds"
    assert p.due(10, 0.0, 10, 0.0) is None                       # already saved at this step
    assert SavePolicy().due(5, 1e9, None, 0.0) is None
    with pytest.raises(OptionsError):
        SavePolicy(every_steps=0)


def test_retention_keeps_the_union_and_always_the_newest():
    steps = list(range(0, 1100, 100))          # 0, 100, ..., 1000
    metrics = {s: {"loss": abs(s - 300) / 100} for s in steps}
    assert RetentionPolicy().keep(steps, metrics) == set(steps)                    # nothing configured: keep all
    assert RetentionPolicy(keep_last=2).keep(steps, metrics) == {900, 1000}
    assert RetentionPolicy(keep_every=500).keep(steps, metrics) == {0, 500, 1000}  # newest always kept
    best = RetentionPolicy(keep_best=2, metric="loss").keep(steps, metrics)
    assert best == {300, 400, 1000}                                                # 200/400 tie: later wins
    worst = RetentionPolicy(keep_best=1, metric="loss", mode="max").keep(steps, metrics)
    assert worst == {1000}
    both = RetentionPolicy(keep_last=1, keep_every=400).keep(steps, metrics, pinned=frozenset({100, 12345}))
    assert both == {0, 400, 800, 1000, 100}
    with pytest.raises(OptionsError):
        RetentionPolicy(keep_best=2)                                               # needs a metric


# ---------------------------------------------------------------------------------------------- manager


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 8)
        self.b = torch.nn.Linear(8, 4)


def make_state(seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "step": 0}


def train_step(state, step):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
    loss = state["model"].b(state["model"].a(x)).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["step"] = step + 1
    return float(loss.detach())


def params(state):
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def committed(mgr):
    return [i.step for i in mgr.steps() if i.status == "committed"]


@pytest.mark.parametrize("async_save", [True, False])
def test_three_lines_train_save_restore(tmp_path, async_save):
    root = str(tmp_path / "run")
    state = make_state()
    with CheckpointManager(root, every_steps=3, keep_last=2, async_save=async_save,
                           save_policy=SavePolicy(last_step=10)) as mgr:
        assert mgr.restore(state) is None
        for step in range(11):
            train_step(state, step)
            mgr.maybe_save(step, state, metrics={"loss": 1.0 / (step + 1)})
    saved = params(state)
    with CheckpointManager(root, every_steps=3, keep_last=2, save_policy=SavePolicy(last_step=10)) as mgr:
        assert committed(mgr) == [9, 10]           # 0, 3, 6 saved and deleted by keep_last=2
        info = {i.step: i for i in mgr.steps()}[10]
        assert info.world_size == 1 and info.nbytes > 0 and info.metrics == {"loss": pytest.approx(1 / 11)}
        fresh = make_state(seed=1)
        assert mgr.restore(fresh) == 10
        assert all(torch.equal(fresh["model"].state_dict()[k], v) for k, v in saved.items())
        assert fresh["step"] == 11 and fresh["optim"].state_dict()["state"][0]["step"] == 11
        assert liferaft.inspect(info.path).metadata["step"] == 10


def _flip_byte(step_path):
    data = sorted(os.path.join(d, f) for d, _, fs in os.walk(step_path) for f in fs if f.endswith(".bin"))
    with open(data[0], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def _saved_steps(root: str, n: int) -> dict:
    """Steps 0..n-1 saved (synchronously) under ``root``; their parameters by step."""
    state = make_state()
    snaps = {}
    with CheckpointManager(root, every_steps=1, async_save=False) as mgr:
        for step in range(n):
            train_step(state, step)
            mgr.maybe_save(step, state)
            snaps[step] = params(state)
    return snaps


def test_restore_skips_broken_steps_with_a_warning_and_start_removes_leftovers(tmp_path):
    root = str(tmp_path / "run")
    snaps = _saved_steps(root, 4)
    _flip_byte(os.path.join(root, "step-0000000003"))                         # newest: bad checksum
    os.remove(os.path.join(root, "step-0000000002", "COMMIT"))               # next: never committed
    with pytest.warns(UserWarning, match="step 3"), CheckpointManager(root) as mgr:
        fresh = make_state(seed=5)
        assert mgr.restore(fresh) == 1
        assert not os.path.exists(os.path.join(root, "step-0000000002"))  # leftover removed by the start's pass
    assert all(torch.equal(fresh["model"].state_dict()[k], v) for k, v in snaps[1].items())
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no step 7"):
            mgr.restore(make_state(), step=7)
        with pytest.raises(liferaft.CorruptCheckpointError):
            mgr.restore(make_state(), step=3)
        assert mgr.restore(make_state(), step=0) == 0


def test_a_step_folder_renamed_is_not_restored_as_the_step_its_name_says(tmp_path):
    # step 0 renamed step-500 was restored as step 500 with step 0's weights (fuzzing); it is listed as corrupt
    # and skipped (its manifest records the step it was saved at)
    root = str(tmp_path / "run")
    snaps = _saved_steps(root, 3)
    os.rename(os.path.join(root, "step-0000000000"), os.path.join(root, "step-0000000500"))
    with pytest.warns(UserWarning, match="records step 0"), CheckpointManager(root) as mgr:
        fresh = make_state(seed=5)
        assert mgr.restore(fresh) == 2
        assert {s.step: s.status for s in mgr.steps()}[500] == "corrupt"
    assert all(torch.equal(fresh["model"].state_dict()[k], v) for k, v in snaps[2].items())
    assert os.path.isdir(os.path.join(root, "step-0000000500"))          # never deleted by liferaft


def test_manifest_damage_is_listed_as_corrupt(tmp_path):
    root = str(tmp_path / "run")
    state = make_state()
    with CheckpointManager(root, every_steps=1, async_save=False) as mgr:
        mgr.maybe_save(0, state)
        mgr.maybe_save(1, state)
    step1 = os.path.join(root, "step-0000000001")
    marker = json.load(open(os.path.join(step1, "COMMIT")))
    with open(os.path.join(step1, marker["manifest"]), "a") as f:
        f.write(" ")
    with CheckpointManager(root) as mgr:
        status = {i.step: i.status for i in mgr.steps()}
        assert status == {0: "committed", 1: "corrupt"}
        with pytest.warns(UserWarning, match="skipping step 1"):
            assert mgr.restore(make_state()) == 0
        _flip_byte(os.path.join(root, "step-0000000000"))
        deep = {i.step: (i.status, i.reason) for i in mgr.steps(verify=True)}
        assert deep[0][0] == "corrupt" and "checksum" in deep[0][1]


def test_keep_every_best_and_pins(tmp_path):
    root = str(tmp_path / "run")
    state = make_state()
    losses = {s: (s - 4) ** 2 for s in range(10)}          # best at step 4, then 3/5
    with CheckpointManager(root, every_steps=1, keep_last=1, async_save=False,
                           retention=RetentionPolicy(keep_every=5, keep_best=1, metric="loss")) as mgr:
        for step in range(10):
            if step == 2:
                mgr.pin(1)
            mgr.maybe_save(step, state, metrics={"loss": losses[step]})
    with CheckpointManager(root) as mgr:
        assert committed(mgr) == [0, 1, 4, 5, 9]            # every 5th, best (4), newest (9), pinned (1)
        mgr.unpin(1)
        assert not {i.step: i.pinned for i in mgr.steps()}[1]


def test_a_second_job_on_the_same_root_is_refused(tmp_path):
    root = str(tmp_path / "run")
    # (a lease of 5 s, renewed every 1.7 s: a 1 s lease renewed every 0.33 s went stale on a loaded 2-core machine
    # when the renewing thread waited over a second for a core; job-b watches it for up to those 5 s, then refuses)
    first = CheckpointManager(root, job=JobOptions(job_id="job-a", lease_ttl=5.0))
    try:
        with pytest.raises(CheckpointBusyError, match="job-a"):
            CheckpointManager(root, job=JobOptions(job_id="job-b", lease_ttl=3.0))
        again = CheckpointManager(root, job=JobOptions(job_id="job-a", lease_ttl=5.0))     # a restart of the same job
        again.close()
        with pytest.raises(CheckpointBusyError, match="lost its lease"):  # ... took the lease over
            first.save(0, make_state())
    finally:
        first.close()
    second = CheckpointManager(root, job=JobOptions(job_id="job-b", lease_ttl=1.0))         # free after close
    second.close()
    assert not os.path.exists(os.path.join(root, "LEASE"))


def test_preemption_signal_saves_at_the_next_call(tmp_path):
    root = str(tmp_path / "run")
    state = make_state()
    with CheckpointManager(root, every_steps=100, preemption=PreemptionOptions(signals=[signal.SIGUSR1])) as mgr:
        assert not mgr.maybe_save(3, state)
        os.kill(os.getpid(), signal.SIGUSR1)
        train_step(state, 4)
        assert mgr.maybe_save(4, state) and mgr.preempted
        assert committed(mgr) == [4]                           # committed before maybe_save returned
        assert liferaft.inspect(os.path.join(root, "step-0000000004")).metadata["reason"] == "preemption"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handler restored


def test_every_seconds_and_force(tmp_path):
    state = make_state()
    with CheckpointManager(str(tmp_path / "run"), async_save=False, save_policy=SavePolicy(every_seconds=1e-6)) as mgr:
        assert mgr.maybe_save(1, state) and mgr.maybe_save(2, state)
        assert not mgr.maybe_save(2, state)                    # never the same step twice
        assert mgr.maybe_save(2, state, force=True)
        assert committed(mgr) == [1, 2]


def test_manager_on_memory_storage():
    state = make_state()
    with CheckpointManager("memory://mgr-test", every_steps=1, keep_last=1, async_save=False) as mgr:
        for s in range(3):
            train_step(state, s)
            mgr.maybe_save(s, state)
    with CheckpointManager("memory://mgr-test") as mgr:      # deletions finished at close
        assert committed(mgr) == [2]
        fresh = make_state(seed=3)
        assert mgr.restore(fresh) == 2
        assert torch.equal(fresh["model"].a.weight, state["model"].a.weight)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES, errno.EROFS])
@pytest.mark.parametrize("async_save", [True, False])
def test_storage_errors_fail_the_save_cleanly_and_training_goes_on(tmp_path, code, async_save):
    register_scheme("failing", FailingStorage)
    FailingStorage.errno, FailingStorage.active = code, False
    root = str(tmp_path / "run")
    state = make_state()
    try:
        with CheckpointManager(f"failing://{root}", every_steps=1, async_save=async_save) as mgr:
            mgr.maybe_save(0, state)
            mgr.wait()                                  # step 0 committed before the storage "breaks"
            FailingStorage.active = True
            train_step(state, 1)                        # (unchanged chunks would be referenced, not written)
            with pytest.raises(liferaft.StorageError, match=os.strerror(code)):
                mgr.maybe_save(1, state)            # sync: fails here
                mgr.maybe_save(2, state)            # async: step 1 failed in the background, raised here
            FailingStorage.active = False
            train_step(state, 3)
            assert mgr.maybe_save(3, state)
            mgr.wait()
            assert committed(mgr) == [0, 3]         # no partial step visible
            assert {i.step for i in mgr.steps()} == {0, 3}
        fresh = make_state(seed=9)
        with CheckpointManager(root) as mgr:
            assert mgr.restore(fresh) == 3
        assert torch.equal(fresh["model"].a.weight, state["model"].a.weight)
    finally:
        FailingStorage.active, FailingStorage.errno = True, errno.ENOSPC


def test_truncated_data_file_is_skipped_on_restore(tmp_path):
    root = str(tmp_path / "run")
    state = make_state()
    with CheckpointManager(root, every_steps=1, async_save=False) as mgr:
        mgr.maybe_save(0, state)
        train_step(state, 0)
        mgr.maybe_save(1, state)
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "step-0000000001")) for f in fs
            if f.endswith(".bin")]
    with open(data[0], "r+b") as f:
        f.truncate(10)
    with CheckpointManager(root) as mgr:
        assert {i.step: i.status for i in mgr.steps()}[1] == "corrupt"
        with pytest.warns(UserWarning, match="truncated"):
            assert mgr.restore(make_state()) == 0
