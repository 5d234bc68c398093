"""The manager's option objects (each validated on its own, OptionsError naming the field; the shorthands given
once), signal handlers installed only at the first maybe_save or by handle_preemption() and put back by close(),
the tiers as a component that never imports the manager, and the remote tier's fallback rule."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import warnings

import pytest
import torch

import liferaft
from liferaft import (
    CheckpointManager,
    JobOptions,
    OptionsError,
    PreemptionOptions,
    RetentionPolicy,
    SavePolicy,
    StateMismatchError,
    TierOptions,
)
from liferaft.tiers.memory import MemoryTier


def _state(v: float) -> dict:
    return {"w": torch.full((64,), v), "step": int(v)}


@pytest.mark.parametrize("make, field", [
    (lambda: SavePolicy(every_steps=0), "every_steps"),
    (lambda: SavePolicy(every_seconds="often"), "every_seconds"),      # type: ignore[arg-type]
    (lambda: SavePolicy(every_seconds=-1.0), "every_seconds"),
    (lambda: SavePolicy(at_steps=["x"]), "at_steps"),                  # type: ignore[list-item]
    (lambda: SavePolicy(full_every=0), "full_every"),
    (lambda: SavePolicy(mtbf_hours=0.0), "mtbf_hours"),
    (lambda: RetentionPolicy(keep_last=0), "keep_last"),
    (lambda: RetentionPolicy(mode="median"), "mode"),                   # type: ignore[arg-type]
    (lambda: TierOptions(None), "memory"),                              # type: ignore[arg-type]
    (lambda: TierOptions(object(), memory_every=0), "memory_every"),    # type: ignore[arg-type]
    (lambda: TierOptions(object(), memory_every="often"), "memory_every"),  # type: ignore[arg-type]
    (lambda: TierOptions(object(), remote_every=0), "remote_every"),    # type: ignore[arg-type]
    (lambda: TierOptions(object(), remote="/x", drain=False), "remote"),  # type: ignore[arg-type]
    (lambda: PreemptionOptions(signals=[12345]), "signals"),
    (lambda: PreemptionOptions(deadline=0), "deadline"),
    (lambda: PreemptionOptions(install="now"), "install"),              # type: ignore[arg-type]
    (lambda: JobOptions(job_id=""), "job_id"),
    (lambda: JobOptions(lease_ttl=float("nan")), "lease_ttl"),
    # what would be silently changed (never saved, saved at another step) or accepted as another type
    (lambda: SavePolicy(last_step="3"), "last_step"),                  # type: ignore[arg-type]
    (lambda: SavePolicy(last_step=-3), "last_step"),
    (lambda: SavePolicy(last_step=2.5), "last_step"),                  # type: ignore[arg-type]
    (lambda: SavePolicy(at_steps=[2.7]), "at_steps"),                  # type: ignore[list-item]
    (lambda: SavePolicy(at_steps="123"), "at_steps"),                  # type: ignore[arg-type]
    (lambda: SavePolicy(at_steps={"1": 1}), "at_steps"),               # type: ignore[arg-type]
    (lambda: SavePolicy(at_steps=[-5]), "at_steps"),
    (lambda: SavePolicy(at_steps=[True]), "at_steps"),
    (lambda: SavePolicy(at_steps=5), "at_steps"),                      # type: ignore[arg-type]
    (lambda: SavePolicy(every_steps=True), "every_steps"),
    (lambda: SavePolicy(every_steps=2.0), "every_steps"),              # type: ignore[arg-type]
    (lambda: SavePolicy(every_seconds=[1]), "every_seconds"),          # type: ignore[arg-type]
    (lambda: SavePolicy(every_seconds=True), "every_seconds"),
    (lambda: SavePolicy(every_seconds=float("inf")), "every_seconds"),
    (lambda: SavePolicy(full_every=True), "full_every"),
    (lambda: SavePolicy(mtbf_hours=True), "mtbf_hours"),
    (lambda: SavePolicy(mtbf_hours="x"), "mtbf_hours"),                # type: ignore[arg-type]
    (lambda: RetentionPolicy(keep_last=True), "keep_last"),
    (lambda: RetentionPolicy(keep_every=2.0), "keep_every"),           # type: ignore[arg-type]
    (lambda: RetentionPolicy(keep_best=1, metric=5), "metric"),        # type: ignore[arg-type]
    (lambda: RetentionPolicy(keep_best=1, metric=""), "metric"),
    (lambda: RetentionPolicy(keep_best=1), "metric"),
    (lambda: RetentionPolicy(metric="loss"), "keep_best"),
    (lambda: RetentionPolicy(mode=["min"]), "mode"),                    # type: ignore[arg-type]
    (lambda: TierOptions(object()), "memory"),                          # type: ignore[arg-type]
    (lambda: TierOptions(object(), drain="no"), "drain"),               # type: ignore[arg-type]
    (lambda: TierOptions(object(), remote=5), "remote"),                # type: ignore[arg-type]
    (lambda: TierOptions(object(), remote_every=True), "remote_every"),  # type: ignore[arg-type]
    (lambda: TierOptions(object(), memory_every=True), "memory_every"),  # type: ignore[arg-type]
    (lambda: PreemptionOptions(signals=[signal.SIGKILL]), "signals"),
    (lambda: PreemptionOptions(signals=[signal.SIGTERM, signal.SIGSTOP]), "signals"),
    (lambda: PreemptionOptions(signals=[True]), "signals"),
    (lambda: PreemptionOptions(signals=None), "signals"),               # type: ignore[arg-type]
    (lambda: PreemptionOptions(signals={15: 1}), "signals"),            # type: ignore[arg-type]
    (lambda: PreemptionOptions(deadline=True), "deadline"),
    (lambda: PreemptionOptions(deadline=float("inf")), "deadline"),
    (lambda: JobOptions(lease_ttl=1e300), "lease_ttl"),
    (lambda: JobOptions(lease_ttl=1e-9), "lease_ttl"),
    (lambda: JobOptions(lease_ttl=True), "lease_ttl"),
])
def test_each_option_object_refuses_a_bad_value_naming_the_field(make, field):
    with pytest.raises(OptionsError, match=field):
        make()


def test_options_are_frozen_and_normalised():
    p = SavePolicy(at_steps=[3, 1], every_seconds="auto")
    assert p.at_steps == frozenset({1, 3}) and p.auto_interval
    with pytest.raises(AttributeError):
        p.every_steps = 3                                                 # type: ignore[misc]
    assert PreemptionOptions(signals=[signal.SIGUSR1]).signals == (signal.SIGUSR1,)


def test_the_edges_of_the_ranges_are_accepted():
    assert SavePolicy(at_steps=[0], last_step=0).at_steps == frozenset({0})
    assert JobOptions(lease_ttl=1).lease_ttl == 1 and JobOptions(lease_ttl=86400.0).lease_ttl == 86400.0
    assert RetentionPolicy(keep_best=2, metric="loss").metric == "loss"
    assert PreemptionOptions(signals=[signal.SIGUSR1, signal.SIGUSR1]).signals == (signal.SIGUSR1,)
    assert PreemptionOptions(signals=()).signals == ()


@pytest.mark.parametrize("param, value, expected", [
    ("save_policy", {"every_steps": 2}, "SavePolicy"),
    ("retention", 3, "RetentionPolicy"),
    ("preemption", {"signals": [15]}, "PreemptionOptions"),
    ("job", "abc", "JobOptions"),
    ("tiers", True, "TierOptions"),
    ("save_options", {"staging": "blocking"}, "SaveOptions"),
    ("load_options", {"x": 1}, "LoadOptions"),
    ("async_save", "no", "True or False"),
])
def test_the_manager_refuses_a_parameter_of_the_wrong_type_naming_it(tmp_path, param, value, expected):
    with pytest.raises(OptionsError, match=f"{param}=.*{expected}"):
        CheckpointManager(str(tmp_path / "run"), **{param: value})


def test_a_shorthand_and_the_same_field_of_a_policy_is_refused(tmp_path):
    with pytest.raises(OptionsError, match="every_steps is given twice"):
        CheckpointManager(str(tmp_path / "a"), every_steps=2, save_policy=SavePolicy(every_steps=3))
    with pytest.raises(OptionsError, match="keep_last is given twice"):
        CheckpointManager(str(tmp_path / "b"), keep_last=2, retention=RetentionPolicy(keep_last=3))
    with CheckpointManager(str(tmp_path / "c"), every_steps=2, keep_last=1,
                           save_policy=SavePolicy(last_step=9), retention=RetentionPolicy(keep_every=4)) as mgr:
        assert mgr.save_policy == SavePolicy(every_steps=2, last_step=9)
        assert mgr.retention == RetentionPolicy(keep_last=1, keep_every=4)


def test_constructing_installs_no_handler_the_first_maybe_save_does_and_close_puts_it_back(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    mgr = CheckpointManager(str(tmp_path / "run"), every_steps=100, async_save=False,
                            preemption=PreemptionOptions(signals=[signal.SIGUSR1]))
    try:
        assert signal.getsignal(signal.SIGUSR1) is before                 # nothing installed by the constructor
        assert not mgr.maybe_save(1, _state(1.0))
        assert signal.getsignal(signal.SIGUSR1) is not before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.maybe_save(2, _state(2.0)) and mgr.preempted
    finally:
        mgr.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_explicit_install_only_by_handle_preemption(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    with CheckpointManager(str(tmp_path / "run"), every_steps=100, async_save=False,
                           preemption=PreemptionOptions(signals=[signal.SIGUSR1], install="explicit")) as mgr:
        assert not mgr.maybe_save(1, _state(1.0))
        assert signal.getsignal(signal.SIGUSR1) is before                 # "explicit": maybe_save installs nothing
        mgr.handle_preemption()
        mgr.handle_preemption()                                           # idempotent
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.maybe_save(2, _state(2.0)) and mgr.preempted
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_first_maybe_save_from_a_thread_does_not_stop_the_main_thread_installing(tmp_path):
    import threading

    before = signal.getsignal(signal.SIGUSR1)
    with CheckpointManager(str(tmp_path / "run"), every_steps=100, async_save=False,
                           preemption=PreemptionOptions(signals=[signal.SIGUSR1])) as mgr:
        t = threading.Thread(target=mgr.maybe_save, args=(1, _state(1.0)))
        t.start()
        t.join()
        assert signal.getsignal(signal.SIGUSR1) is before                 # a worker thread cannot install
        mgr.handle_preemption()
        assert signal.getsignal(signal.SIGUSR1) is not before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.maybe_save(2, _state(2.0)) and mgr.preempted
    assert signal.getsignal(signal.SIGUSR1) is before
    with CheckpointManager(str(tmp_path / "run2"), every_steps=100, async_save=False,
                           preemption=PreemptionOptions(signals=[signal.SIGUSR1])) as mgr:
        t = threading.Thread(target=mgr.maybe_save, args=(1, _state(1.0)))
        t.start()
        t.join()
        assert not mgr.maybe_save(2, _state(2.0))                         # the main thread's first maybe_save
        assert signal.getsignal(signal.SIGUSR1) is not before
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_two_managers_closed_in_any_order_put_the_original_handler_back(tmp_path, order):
    before = signal.getsignal(signal.SIGUSR1)
    opts = PreemptionOptions(signals=[signal.SIGUSR1])
    mgrs = {n: CheckpointManager(str(tmp_path / n), every_steps=100, async_save=False, preemption=opts) for n in "AB"}
    try:
        for n in "AB":
            mgrs[n].handle_preemption()
        first, second = mgrs[order[0]], mgrs[order[1]]
        first.close()
        assert signal.getsignal(signal.SIGUSR1) is not before             # the other one still handles it
        os.kill(os.getpid(), signal.SIGUSR1)
        assert second.maybe_save(1, _state(1.0)) and second.preempted
        second.close()
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        for m in mgrs.values():
            m.close()
        signal.signal(signal.SIGUSR1, before)


def test_the_tiers_component_does_not_import_the_manager():
    from liferaft.manager import tiering

    with open(tiering.__file__) as f:
        tree = ast.parse(f.read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "liferaft.manager.manager" not in imported and "liferaft.manager" not in imported
    assert not any(c.name.endswith("Mixin") for c in ast.walk(tree) if isinstance(c, ast.ClassDef))


def test_a_remote_step_that_does_not_match_the_state_raises_instead_of_restoring_nothing(tmp_path, shm):
    """Defect: the remote tier fell back on any error, so a state that did not match made restore return None
    ("nothing to restore": the job would start over) when only the remote tier held the steps."""
    root, remote = str(tmp_path / "root"), str(tmp_path / "remote")
    tiers = TierOptions(MemoryTier("job", node="n0", base=shm), remote=remote)
    with CheckpointManager(root, every_steps=1, async_save=False, tiers=tiers) as mgr:
        for step in range(2):
            mgr.maybe_save(step, _state(float(step)))
    shutil.rmtree(root)                                                   # the node-local disk is lost
    shutil.rmtree(shm)                                                    # and so is the node's memory
    fresh = TierOptions(MemoryTier("job", node="n0", base=shm), remote=remote)
    with CheckpointManager(root, tiers=fresh) as mgr:
        got = _state(0.0)
        assert mgr.restore(got) == 1 and torch.equal(got["w"], _state(1.0)["w"])   # from the remote tier
        with pytest.raises(StateMismatchError):
            mgr.restore({"other": torch.zeros(3)})
    liferaft.verify(os.path.join(remote, "step-0000000001"))


def test_a_damaged_remote_step_is_skipped_for_the_one_before(tmp_path, shm):
    root, remote = str(tmp_path / "root"), str(tmp_path / "remote")
    with CheckpointManager(root, every_steps=1, async_save=False,
                           tiers=TierOptions(MemoryTier("job", node="n0", base=shm), remote=remote)) as mgr:
        for step in range(2):
            mgr.maybe_save(step, _state(float(step)))
    shutil.rmtree(root)
    shutil.rmtree(shm)
    data = os.path.join(remote, "step-0000000001", "data")
    for dirpath, _, files in os.walk(data):
        for f in files:
            with open(os.path.join(dirpath, f), "r+b") as fh:
                fh.seek(40)
                fh.write(b"\xff" * 8)                                     # damage step 1's bytes
    with CheckpointManager(root, tiers=TierOptions(MemoryTier("job", node="n0", base=shm), remote=remote)) as mgr:
        got = _state(9.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mgr.restore(got) == 0
        assert any("step 1" in str(w.message) and "trying step 0" in str(w.message) for w in caught)
        assert torch.equal(got["w"], _state(0.0)["w"])


def test_save_options_metadata_keys_must_be_strings():
    """JSON would turn a key 1 into "1" silently: refused, naming it (helper-113), at any depth."""
    with pytest.raises(liferaft.OptionsError, match="key 1 is a int"):
        liferaft.SaveOptions(metadata={1: 2})
    with pytest.raises(liferaft.OptionsError, match="key 2.5"):
        liferaft.SaveOptions(metadata={"a": [{"b": {2.5: 1}}]})
    assert liferaft.SaveOptions(metadata={"a": [1, {"b": 2}]}).metadata == {"a": [1, {"b": 2}]}
