"""A manager with tiers asks the memory tier first: when it holds a complete step at least as new as every step a
manager of the root began to save to the root or the remote tier (the root's ``INTENT``, one small read), the restore
loads it without listing either — on an object store a LIST walks every key, and it blocked the restart before
memory was asked. Without a usable record, or with a slower tier holding a newer step, the restore lists and picks
exactly what it picked before — also when the memory it finds is a stale node's, or runs without tiers saved newer
steps in between. ``INTENT`` is hostile bytes like any other file."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch

from liferaft import CheckpointManager, JobOptions, PreemptionOptions, TierOptions
from liferaft.errors import LiferaftError
from liferaft.manager.listing import INTENT, read_branches, read_intent, read_intent_at
from liferaft.tiers.memory import MemoryTier

NO_SIGNALS = PreemptionOptions(signals=())


def _state(v: float) -> dict:
    return {"w": torch.full((64,), v), "step": int(v)}


def _tier(shm: str) -> MemoryTier:
    return MemoryTier("job", node="n0", base=shm)


def _run(root, shm: str, steps: range, **tiers) -> None:
    with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS,
                           job=JobOptions(lease_ttl=30.0),
                           tiers=TierOptions(_tier(shm), **tiers)) as mgr:
        for step in steps:
            mgr.maybe_save(step, _state(float(step)))
            mgr._tiers.wait()           # (no memory save skipped as busy)


def test_memory_answers_while_the_root_listing_hangs_and_the_remote_tier_is_never_asked(s3_server, monkeypatch,
                                                                                         shm):
    """Root and remote tier on S3 behind a proxy that holds the first LIST after the job restarts (the start's
    listing of the root for its clean-up, which runs behind): the construction and the restore return the memory
    tier's newest step well before that LIST is answered, and no request at all goes to the remote tier. With the
    root's INTENT removed the same restore lists the remote tier first."""
    import time

    from liferaft.storage.s3 import S3Storage
    from liferaft.testing.s3server import FaultProxy

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    base = f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"
    hold = 5.0
    with FaultProxy(s3_server.endpoint_url) as proxy:
        root, remote = S3Storage(f"{base}/root", endpoint_url=proxy.url), S3Storage(f"{base}/remote",
                                                                                      endpoint_url=proxy.url)
        _run(root, shm, range(6), remote=remote, memory_every=1)       # memory: 5; root: 0 2 4; remote too
        tiers = TierOptions(_tier(shm), remote=remote)
        seen = len(proxy.requests)
        proxy.stall_next(1, hold, path_has="list-type")
        t0 = time.monotonic()
        with CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0), tiers=tiers) as mgr:
            got = _state(-1.0)
            assert mgr.restore(got) == 5 and torch.equal(got["w"], _state(5.0)["w"])
            waited = time.monotonic() - t0
        assert waited < hold / 2, waited            # (the held LIST is answered after `hold` s)
        after = proxy.requests[seen:]
        assert [r.outcome for r in after if "list-type" in r.path][:1] == ["stall"]     # the start's, held
        assert not [r for r in after if "/remote" in r.path or "remote%2F" in r.path], after
        root.delete(INTENT)
        seen = len(proxy.requests)
        with CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0), tiers=tiers) as mgr:
            assert mgr.restore(got) == 5
        assert any("list-type" in r.path and "remote%2F" in r.path for r in proxy.requests[seen:])


def test_a_newer_step_on_the_root_is_still_found(tmp_path, shm):
    """Saves straight to the root (drain=False) record a step newer than the memory tier's newest: the restore lists
    the root and loads its newer step."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])
    assert read_intent(CheckpointManager(root, preemption=NO_SIGNALS).storage) == 4


def _intent_path(root: str) -> str:
    return os.path.join(root, INTENT)


@pytest.mark.parametrize("plant", ["garbage", "other-format", "fractional", "symlink", "fifo", "folder", "huge",
                                   "negative", "removed"])
def test_an_intent_that_does_not_hold_makes_the_restore_list(tmp_path, shm, plant):
    """Whatever sits where the root's INTENT belongs, a restore still finds the root's newer step (the record only
    ever saves a listing) and never blocks on it."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    path = _intent_path(root)
    os.remove(path)
    if plant == "garbage":
        open(path, "wb").write(b"\xff{not json")
    elif plant == "other-format":
        open(path, "w").write('{"format": 2, "step": 1}')
    elif plant == "fractional":
        open(path, "w").write('{"format": 1, "step": 2.5}')
    elif plant == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text('{"format": 1, "step": 1}')
        os.symlink(target, path)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "folder":
        os.mkdir(path)
    elif plant == "huge":
        open(path, "w").write(f'{{"format": 1, "step": 1, "pad": "{"x" * (2 << 20)}"}}')
    elif plant == "negative":
        open(path, "w").write('{"format": 1, "step": -1}')
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        assert read_intent(mgr.storage) is None
        got = _state(-1.0)
        assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])


def test_a_rollback_removes_the_newer_steps_everywhere_and_records_the_branch(tmp_path, shm):
    """restore(step=2) then a save: the run goes on from 2, so the rollback is recorded in BRANCHES and the newer
    steps go from the root and the memory tier before anything is saved (left there, the next restore would resume
    on the abandoned future); INTENT is the new epoch's (the old epoch's 6 no longer counts: a restart below it is no
    fork of the new run); a later restore takes the new step."""
    root = str(tmp_path / "root")
    _run(root, shm, range(7), memory_every=1)                          # root: 0 2 4 6 (drained), memory: 6
    with CheckpointManager(root, preemption=NO_SIGNALS, async_save=False,
                           tiers=TierOptions(_tier(shm))) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got, step=2) == 2
        assert [i.step for i in mgr.steps()] == [0, 2, 4, 6]            # (nothing removed until the run goes on)
        mgr.save(3, _state(3.0))
        assert read_intent_at(mgr.storage) == (3, 1) and read_branches(mgr.storage) == ((1, 2),)
        assert [i.step for i in mgr.steps() if i.status == "committed"] == [0, 2, 3]
        assert all(s <= 3 for s in mgr._tiers.local_steps())
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm))) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 3 and torch.equal(got["w"], _state(3.0)["w"])


def test_an_intent_that_cannot_be_written_stops_the_save_on_every_rank(tmp_path, shm):
    """A folder where INTENT belongs cannot be replaced: the save does not start (nothing of it under the root), and
    the error names the file; the restore, finding no record, lists."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    path = _intent_path(root)
    os.remove(path)
    os.mkdir(path)
    open(os.path.join(path, "x"), "w").close()
    with CheckpointManager(root, preemption=NO_SIGNALS, async_save=False, tiers=TierOptions(_tier(shm), drain=False),
                           job=JobOptions(lease_ttl=30.0)) as mgr:
        with pytest.raises(LiferaftError, match="INTENT"):
            mgr.save(8, _state(8.0))
        assert not os.path.exists(os.path.join(root, "step-0000000008"))
        got = _state(-1.0)
        assert mgr.restore(got) == 4


def test_a_stale_nodes_memory_never_wins_over_newer_steps_saved_elsewhere(tmp_path, shm):
    """Node n1 holds step 3 in memory; the job then runs on node n0 alone and saves up to step 10 to the root; n1
    comes back (a node renamed by its rendezvous position, or a host drained and reused): the restore takes step 10,
    not n1's step 3 (a per-node record would have been n1's, and stale)."""
    root = str(tmp_path / "root")
    with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0),
                           tiers=TierOptions(MemoryTier("job", node="n1", base=shm), drain=False,
                                             memory_every=3)) as mgr:
        for step in range(4):
            mgr.maybe_save(step, _state(float(step)))
            mgr._tiers.wait()
    with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0),
                           tiers=TierOptions(MemoryTier("job", node="n0", base=shm), drain=False,
                                             memory_every=100)) as mgr:
        assert mgr.restore(_state(-1.0)) == 2
        for step in range(4, 11):
            mgr.maybe_save(step, _state(float(step)))
    with CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0),
                           tiers=TierOptions(MemoryTier("job", node="n1", base=shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 10 and torch.equal(got["w"], _state(10.0)["w"])


def test_a_run_without_tiers_in_between_is_seen(tmp_path, shm):
    """A run of the job without tiers saves steps 4-10 to the root; the next run with the memory tier (holding step
    3) restores step 10."""
    root = str(tmp_path / "root")
    _run(root, shm, range(4), drain=False, memory_every=3)            # memory: 3; root: 0 2
    with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS) as mgr:
        assert mgr.restore(_state(-1.0)) == 2
        for step in range(4, 11):
            mgr.maybe_save(step, _state(float(step)))
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 10 and torch.equal(got["w"], _state(10.0)["w"])


def test_the_start_listing_is_not_used_after_another_manager_saved(tmp_path):
    """Two managers of the job on one root in one process: A is made, B saves step 10 and closes; A's first restore
    lists again (INTENT is newer than A's start listing) and finds 10."""
    root = str(tmp_path / "root")
    with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS) as mgr:
        for step in range(3):
            mgr.maybe_save(step, _state(float(step)))
    job = JobOptions(job_id="one-job", lease_ttl=30.0)      # (the same job: B takes the lease over)
    a = CheckpointManager(root, preemption=NO_SIGNALS, job=job)
    try:
        a.steps()                                   # (its start listing: steps 0 and 2)
        with CheckpointManager(root, async_save=False, preemption=NO_SIGNALS, job=job) as b:
            b.save(10, _state(10.0))
        got = _state(-1.0)
        assert a.restore(got) == 10 and torch.equal(got["w"], _state(10.0)["w"])
    finally:
        a.close()


def test_every_node_lost_lists_the_root(tmp_path, shm):
    """No memory left: the root's newest step, as before."""
    root = str(tmp_path / "root")
    _run(root, shm, range(6), memory_every=1)
    shutil.rmtree(shm)
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm))) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])


def test_the_first_restore_uses_the_listing_of_the_start(s3_server, monkeypatch):
    """Without tiers the root must be listed to restore, but the manager listed it at its start (for its clean-up,
    holding the lease: no one else writes it): the first restore uses that listing instead of a second LIST; a
    restore after a save lists again."""
    from liferaft.storage.s3 import S3Storage
    from liferaft.testing.s3server import FaultProxy

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        root = S3Storage(url, endpoint_url=proxy.url)
        with CheckpointManager(root, every_steps=2, async_save=False, preemption=NO_SIGNALS,
                               job=JobOptions(lease_ttl=30.0)) as mgr:
            for step in range(5):
                mgr.maybe_save(step, _state(float(step)))
        with CheckpointManager(root, async_save=False, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0)) as mgr:
            lists = lambda: sum("list-type" in r.path for r in proxy.requests)
            assert 4 in [i.step for i in mgr.steps()]       # (waits for the start's listing: it runs behind)
            before = lists()
            got = _state(-1.0)
            assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])
            assert lists() == before
            mgr.save(5, _state(5.0))
            before = lists()
            assert mgr.restore(got) == 5 and lists() > before


def test_a_construction_that_fails_after_the_start_leaves_no_clean_up_running_and_no_lease(tmp_path, shm):
    """The tiers fail to build after the start took the lease and began its clean-up: nothing of that manager keeps
    running (its clean-up would delete, from its old listing, a step a later manager saves again) and another
    job takes the root at once."""
    import threading

    from liferaft.errors import StorageError

    root = str(tmp_path / "root")
    with pytest.raises(StorageError, match="bogus"):
        CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(job_id="a", lease_ttl=600.0),
                          tiers=TierOptions(_tier(shm), remote="bogus://x/y"))
    assert not [t for t in threading.enumerate() if t.name.startswith("liferaft-retention")]
    with CheckpointManager(root, async_save=False, preemption=NO_SIGNALS,
                           job=JobOptions(job_id="b", lease_ttl=600.0)) as mgr:      # (no wait for a stale lease)
        mgr.save(1, _state(1.0))


def test_close_releases_the_lease_when_the_start_clean_up_warning_is_an_error(tmp_path):
    """With warnings as errors, the start's clean-up warning (a foreign folder under a step name) is raised by
    close() — after the lease is released and the deleter stopped, so another job takes the root."""
    import warnings

    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, "step-0000000009"))
    open(os.path.join(root, "step-0000000009", "notes.txt"), "w").write("not liferaft's")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(job_id="a", lease_ttl=600.0))
        with pytest.raises(UserWarning, match="does not write"):
            mgr.close()
    with CheckpointManager(root, async_save=False, preemption=NO_SIGNALS,
                           job=JobOptions(job_id="b", lease_ttl=600.0)) as other:
        other.save(1, _state(1.0))


def test_a_memory_tier_shared_with_another_roots_manager_never_gives_it_that_roots_steps(tmp_path, shm):
    """Two experiments on one node with the same MemoryTier job id: a manager restores only memory copies its own
    root's manager saved (their manifest names the root), never the other experiment's weights — neither a fresh
    root (no INTENT) nor one whose own newest step is older than the other's memory copy."""
    _run(str(tmp_path / "a"), shm, range(11))                  # A: root 0..10, memory 10
    with CheckpointManager(str(tmp_path / "b"), every_steps=2, async_save=False, preemption=NO_SIGNALS,
                           tiers=TierOptions(_tier(shm))) as mgr:
        state = _state(-1.0)
        assert mgr.restore(state) is None and state["step"] == -1         # fresh: nothing of A's
        for step in range(3):
            mgr.maybe_save(step, _state(100.0 + step))                    # B: root 0, 2 (and its memory copy)
            mgr._tiers.wait()
    _run(str(tmp_path / "a"), shm, range(11, 21))                 # A goes on: its memory copy 20 is newest
    with CheckpointManager(str(tmp_path / "b"), every_steps=2, async_save=False, preemption=NO_SIGNALS,
                           tiers=TierOptions(_tier(shm))) as mgr:
        state = _state(-1.0)
        assert mgr.restore(state) == 2 and float(state["w"][0]) == 102.0
        mgr.maybe_save(3, _state(103.0))                              # (no "the root holds step 20")
