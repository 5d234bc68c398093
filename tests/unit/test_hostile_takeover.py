"""A job that lost its root to another job deletes nothing there (hostile review helper-114).

Retention runs after a save is accounted for (the next ``maybe_save``), in a background thread: a job frozen
longer than its lease's ttl (SIGSTOP, a hung node) that comes back must not run the retention pass its last save
queued against the steps the new holder wrote; nor may a root path swapped for a link to another root between two
steps make retention delete there. Every step deletion checks the lease first (``core.commit.guard_commits``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import liferaft
from liferaft import CheckpointBusyError, CheckpointManager, JobOptions
from liferaft.manager.lease import Lease
from liferaft.storage import resolve


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g)}


def _committed(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "COMMIT")))


def _wait_commit(root: str, step: int) -> None:
    marker = os.path.join(root, f"step-{step:010d}", "COMMIT")
    deadline = time.monotonic() + 60
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "the async save never committed"
        time.sleep(0.01)


def _two_saves_the_second_in_flight(root: str) -> CheckpointManager:
    """Job A (keep_last=1, async) with step 1 accounted for and step 2 committed but not yet accounted for: the
    retention pass of step 2 runs at A's next call."""
    mgr = CheckpointManager(root, keep_last=1, async_save=True, job=JobOptions(job_id="A"))
    mgr.save(1, _state(1))
    mgr.wait()
    mgr.save(2, _state(2))
    _wait_commit(root, 2)
    return mgr


def test_retention_after_the_lease_was_taken_deletes_nothing(tmp_path):
    """A's async save of step 2 commits; another job then takes the root (its lease written over A's) and saves
    steps 5-7; A's next maybe_save accounts for step 2 and queues its retention pass (keep_last=1): it must
    delete neither the new holder's steps nor A's own older ones, and say why."""
    root = str(tmp_path / "root")
    mgr = _two_saves_the_second_in_flight(root)
    try:
        for s in (5, 6, 7):       # (job B's steps: written here before its lease, which this process's saves check)
            liferaft.save(os.path.join(root, f"step-{s:010d}"), _state(s))
        Lease(resolve(root), "B")._write()          # job B took the root over (as its acquire writes it)
        before = _committed(root)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointBusyError, match="lost its lease"):
                mgr.maybe_save(3, _state(3), force=True)
            mgr._deleter.shutdown(wait=True)        # (the retention pass queued for step 2 has run)
        assert _committed(root) == before
        assert any("lost its lease" in str(w.message) for w in seen), [str(w.message) for w in seen]
    finally:
        mgr.close()
    for s in (5, 6, 7):
        got = {"w": torch.zeros(4096)}
        liferaft.load(os.path.join(root, f"step-{s:010d}"), got)
        assert torch.equal(got["w"], _state(s)["w"])


def test_root_swapped_for_a_link_to_another_root(tmp_path):
    """The root's path replaced by a link to another job's root between two steps: the retention of A's last
    save deletes nothing there (the lease read through the link is not A's)."""
    root, other = str(tmp_path / "R"), str(tmp_path / "O")
    for s in range(4):
        liferaft.save(os.path.join(other, f"step-{s:010d}"), _state(s))
    mgr = _two_saves_the_second_in_flight(root)
    try:
        os.rename(root, root + ".old")
        os.symlink(other, root)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointBusyError):
                mgr.maybe_save(3, _state(3), force=True)
            mgr._deleter.shutdown(wait=True)
    finally:
        mgr.close()
    assert _committed(other) == [f"step-{s:010d}" for s in range(4)]
    assert _committed(root + ".old") == ["step-0000000001", "step-0000000002"]


_FROZEN = textwrap.dedent("""
    import os, sys, time, torch
    from liferaft import CheckpointManager, JobOptions
    root = sys.argv[1]
    mgr = CheckpointManager(root, keep_last=1, async_save=True, job=JobOptions(job_id="A", lease_ttl=1.5))
    for s in range(3):
        mgr.maybe_save(s, {"w": torch.full((4096,), float(s))}, force=True)
    while not os.path.exists(os.path.join(root, "step-0000000002", "COMMIT")):
        time.sleep(0.01)
    print("ready", flush=True)
    sys.stdin.readline()                            # (stopped here: a step that outlives the lease)
    try:
        mgr.maybe_save(3, {"w": torch.full((4096,), 3.0)}, force=True)
    except Exception as e:
        print("raised", type(e).__name__, flush=True)
    try:
        mgr.close()
    except Exception as e:
        print("close raised", type(e).__name__, flush=True)
""")


def test_frozen_job_comes_back_after_another_took_the_root(tmp_path):
    """Real processes: job A is stopped (SIGSTOP) in a step right after its async save committed; job B takes the
    stale lease, restores and saves; A continues (SIGCONT) and calls maybe_save: B's steps are all there."""
    root = str(tmp_path / "root")
    a = subprocess.Popen([sys.executable, "-c", _FROZEN, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert a.stdout is not None and a.stdin is not None
        assert a.stdout.readline().strip() == "ready"
        os.kill(a.pid, signal.SIGSTOP)
        b = CheckpointManager(root, keep_last=10, async_save=False, job=JobOptions(job_id="B", lease_ttl=1.5))
        try:
            got = {"w": torch.zeros(4096)}
            assert b.restore(got) == 2
            for s in range(3, 7):
                b.maybe_save(s, {"w": torch.full((4096,), 100.0 + s)}, force=True)
            os.kill(a.pid, signal.SIGCONT)
            a.stdin.write("go\n")
            a.stdin.flush()
            out, _ = a.communicate(timeout=120)
            assert "raised CheckpointBusyError" in out, out
            assert {2, 3, 4, 5, 6} <= {i.step for i in b.steps() if i.status == "committed"}
        finally:
            b.close()
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
    for s in range(3, 7):
        got = {"w": torch.zeros(4096)}
        liferaft.load(os.path.join(root, f"step-{s:010d}"), got)
        assert torch.equal(got["w"], torch.full((4096,), 100.0 + s))


def _run_state(run: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(run * 100_000 + step)
    return {"w": torch.randn(8192, generator=g), "run": torch.tensor([run]), "step": torch.tensor([step])}


def _tiered(root: str, base: str, node: str) -> CheckpointManager:
    tier = liferaft.MemoryTier("J", node=node, base=base, replicas=0, keep=1)
    return CheckpointManager(root, every_steps=5, async_save=False,
                             tiers=liferaft.TierOptions(tier, memory_every=1), job=JobOptions(job_id="J"))


def test_a_node_memory_of_the_run_before_is_not_restored_after_the_run_went_on_from_an_older_step(tmp_path):
    """Run 1 on node n1 saves steps 0-10 to memory, its save of step 10 to the root never commits (INTENT says
    10); run 2 on node n2 (no copy of 10 in its memory) restores the root's step 5 and trains 6-10 its own way,
    committing step 10; run 3, back on n1, must restore run 2's step 10, not the copy of run 1's step 10 that n1's
    memory still holds (helper-114: restored silently)."""
    root, base = str(tmp_path / "root"), str(tmp_path / "shm")
    one = _tiered(root, base, "n1")
    for s in range(11):
        one.maybe_save(s, _run_state(1, s))
    one.close()
    shutil.rmtree(os.path.join(root, "step-0000000010"))     # (the root's save of step 10 never committed)
    two = _tiered(root, base, "n2")
    got = _run_state(0, 0)
    assert two.restore(got) == 5 and int(got["run"]) == 1
    for s in range(6, 11):
        two.maybe_save(s, _run_state(2, s))
    two.close()
    three = _tiered(root, base, "n1")
    try:
        got = _run_state(0, 0)
        assert three.restore(got) == 10
        assert int(got["run"]) == 2 and torch.equal(got["w"], _run_state(2, 10)["w"])
    finally:
        three.close()


_TIER_HOLDER = textwrap.dedent("""
    import sys
    from liferaft import MemoryTier
    tier = MemoryTier("train", node="n", base=sys.argv[1], replicas=0)
    print("held", flush=True)
    sys.stdin.readline()
""")


def test_two_live_processes_of_one_memory_tier_namespace_are_refused(tmp_path):
    """Two jobs given the same MemoryTier job id on one node at once (helper-114: their saves removed and published
    each other's files; committed root steps without their data, raw FileNotFoundErrors): the second is refused
    when its tier is made, before anything changes; a tier made again in the same process, and one made after the
    holder died (kill -9), are not."""
    base = str(tmp_path / "shm")
    holder = subprocess.Popen([sys.executable, "-c", _TIER_HOLDER, base], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointBusyError, match="same MemoryTier job id"):
            liferaft.MemoryTier("train", node="n", base=base, replicas=0)
        liferaft.MemoryTier("train", node="other", base=base, replicas=0)     # (another node's namespace)
        liferaft.MemoryTier("other", node="n", base=base, replicas=0)         # (another job id)
    finally:
        holder.kill()
        holder.wait()
    liferaft.MemoryTier("train", node="n", base=base, replicas=0)
    liferaft.MemoryTier("train", node="n", base=base, replicas=0)             # (made again in this process)


def _plant_intent(root: str, step: int) -> None:
    """INTENT as a save of ``step`` cut short leaves it (epoch 0)."""
    with open(os.path.join(root, "INTENT"), "w") as f:
        f.write(f'{{"format": 1, "step": {step}}}')


def test_a_fork_is_not_recorded_by_a_job_that_lost_the_root(tmp_path):
    """A restore below INTENT goes on from an older step (a fork, recorded in BRANCHES at the next save); the job
    then loses its lease: its maybe_save records nothing (helper-115: BRANCHES written before the lease check
    abandoned the new holder's whole run)."""
    root = str(tmp_path / "root")
    liferaft.save(os.path.join(root, "step-0000000010"), _state(10))
    _plant_intent(root, 20)
    mgr = CheckpointManager(root, async_save=False, job=JobOptions(job_id="A"))
    try:
        got = {"w": torch.zeros(4096)}
        assert mgr.restore(got) == 10
        Lease(resolve(root), "B")._write()
        with pytest.raises(CheckpointBusyError):
            mgr.maybe_save(11, _state(11), force=True)
        assert not os.path.exists(os.path.join(root, "BRANCHES"))
    finally:
        mgr.close()


def test_a_newer_committed_step_the_restore_skipped_keeps_the_run_on_its_epoch(tmp_path):
    """Step 20 committed and pinned, but unreadable at this restore (damaged, or a read that failed for a moment):
    the restore goes on from 10 without a fork — step 20 stays a step of the run (helper-115: it was abandoned, a
    later restore(step=20) refused it, gc would delete it)."""
    root = str(tmp_path / "root")
    with CheckpointManager(root, async_save=False, job=JobOptions(job_id="A")) as mgr:
        mgr.save(10, _state(10))
        mgr.save(20, _state(20))
        mgr.pin(20)
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "step-0000000020")) for f in fs
            if f.endswith(".bin")]
    saved = {p: open(p, "rb").read() for p in data}
    for p in data:
        with open(p, "r+b") as f:
            f.write(b"\xff" * 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointManager(root, async_save=False, job=JobOptions(job_id="A")) as mgr:
            got = {"w": torch.zeros(4096)}
            assert mgr.restore(got) == 10
            mgr.save(11, _state(11))
    assert not os.path.exists(os.path.join(root, "BRANCHES"))
    for p, b in saved.items():                      # (the read error passes)
        with open(p, "wb") as f:
            f.write(b)
    with CheckpointManager(root, async_save=False, job=JobOptions(job_id="A")) as mgr:
        got = {"w": torch.zeros(4096)}
        assert mgr.restore(got, step=20) == 20 and torch.equal(got["w"], _state(20)["w"])
    assert liferaft.gc(root, keep_last=1, dry_run=True).deleted == (10, 11)


_FORKED_HOLDER = textwrap.dedent("""
    import os, sys, time
    from liferaft import MemoryTier
    tier = MemoryTier("train", node="n", base=sys.argv[1], replicas=0)
    if os.fork() == 0:                  # (a DataLoader worker, say: it outlives its parent's kill -9)
        time.sleep(60)
        os._exit(0)
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_forked_child_does_not_keep_its_parents_namespace_lock(tmp_path):
    """A rank's forked child (a DataLoader worker busy in __getitem__) outlives the rank's kill -9: the restarted
    rank takes its namespace at once (helper-116: refused until the orphan ended, a restart attempt lost); and
    release() of one tier leaves the namespace locked for as long as its process lives."""
    base = str(tmp_path / "shm")
    holder = subprocess.Popen([sys.executable, "-c", _FORKED_HOLDER, base], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointBusyError):
            liferaft.MemoryTier("train", node="n", base=base, replicas=0)
        os.kill(holder.pid, signal.SIGKILL)                 # (the rank; its child lives on)
        holder.wait()
        liferaft.MemoryTier("train", node="n", base=base, replicas=0)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


_RELEASER = textwrap.dedent("""
    import sys
    from liferaft import MemoryTier
    tier = MemoryTier("train", node="n", base=sys.argv[1], replicas=0)
    tier.release()                      # (its node's namespace folder removed; the process goes on)
    print("released", flush=True)
    sys.stdin.readline()
""")


def test_a_released_namespace_stays_locked_while_its_process_lives(tmp_path):
    base = str(tmp_path / "shm")
    holder = subprocess.Popen([sys.executable, "-c", _RELEASER, base], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "released"
        shutil.rmtree(os.path.join(base, "train"), ignore_errors=True)
        with pytest.raises(CheckpointBusyError, match="same MemoryTier job id"):
            liferaft.MemoryTier("train", node="n", base=base, replicas=0)
    finally:
        holder.kill()
        holder.wait()


def test_a_namespace_lock_that_cannot_be_made_is_a_clear_error(tmp_path):
    base = str(tmp_path / "shm")
    os.makedirs(os.path.join(base, ".locks", "train", "n", "rank-0.lock"))     # (a folder where the lock belongs)
    with pytest.raises(CheckpointBusyError, match="cannot be made"):
        liferaft.MemoryTier("train", node="n", base=base, replicas=0)


def test_a_value_saved_per_rank_or_as_a_list_is_never_looked_into():
    """``value_within`` walks dicts only, by keys of the part's own type: a per-rank value's rows are the ranks'
    (helper-116: a 2-rank value loaded both ranks' rows into one object, silently), a saved list is no object's
    entries."""
    from liferaft.state.matching import value_within
    from liferaft.state.values import PerRank

    saved = {"x": PerRank([["a"], ["b"]]), "l": ["p", "q"], "d": {0: "int", "0": "str"}}
    assert value_within(saved.__contains__, saved.__getitem__, ("x", 0)) is None
    assert value_within(saved.__contains__, saved.__getitem__, ("l", 1)) is None
    assert value_within(saved.__contains__, saved.__getitem__, ("d", 0)) == ("d", 1, "int")
    assert value_within(saved.__contains__, saved.__getitem__, ("d", "0")) == ("d", 1, "str")


def test_an_ignored_saved_dict_is_not_loaded_into_the_live_object(tmp_path):
    """``LoadOptions(ignore_keys=...)``: a saved dict the load ignores is no source for a live object's entries
    (helper-116: the live scheduler was overwritten from it)."""
    m = torch.nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = torch.optim.lr_scheduler.StepLR(o, 2)
    saved = {**s.state_dict(), "last_epoch": 7}
    liferaft.save(str(tmp_path / "ck"), {"sched": saved})
    r = liferaft.load(str(tmp_path / "ck"), {"sched": s}, strict=False,
                      options=liferaft.LoadOptions(ignore_keys=("sched",)))
    assert s.last_epoch == 0 and "sched.last_epoch" in r.missing_keys


def test_an_intent_without_an_epoch_counts_as_this_epochs(tmp_path):
    """An INTENT written before INTENT recorded epochs, on a root that was rolled back: a restore below it still
    records a fork (helper-116: read as epoch 0, it recorded none)."""
    root = str(tmp_path / "root")
    liferaft.save(os.path.join(root, "step-0000000005"), _state(5))
    with open(os.path.join(root, "BRANCHES"), "w") as f:
        f.write("[[1, 5]]")
    _plant_intent(root, 10)
    with CheckpointManager(root, async_save=False, job=JobOptions(job_id="A")) as mgr:
        got = {"w": torch.zeros(4096)}
        assert mgr.restore(got) == 5
        mgr.save(6, _state(6))
    with open(os.path.join(root, "BRANCHES")) as f:
        assert json.load(f) == [[1, 5], [2, 5]]


def test_a_job_id_named_like_the_lock_folder_is_refused(tmp_path):
    """A MemoryTier job id '.locks' would make its namespace the folder of every job's locks, and its release()
    remove another job's live lock files (helper-118)."""
    with pytest.raises(liferaft.OptionsError, match=".locks"):
        liferaft.MemoryTier(".locks", node="jobA", base=str(tmp_path / "shm"))
