"""The memory tier in one process: another job's namespace is never read, a damaged copy is refused, the
manager falls back to the root, memory_every="auto", release, and the pure planning functions."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch

import liferaft
from liferaft import CheckpointManager, SavePolicy, TierOptions
from liferaft.tiers.memory import MemoryTier, file_holders, newest_complete


@pytest.fixture
def base():
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-unit-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def state(v: float):
    return {"w": torch.full((256, 256), v), "step": int(v)}


def test_a_namespace_belongs_to_one_job(base):
    MemoryTier("job-a", node="n0", base=base).save(3, state(3.0), wait=True)
    assert MemoryTier("job-b", node="n0", base=base).restore(state(0.0)) is None
    got = state(0.0)
    assert MemoryTier("job-a", node="n0", base=base).restore(got) == 3 and torch.equal(got["w"], state(3.0)["w"])


def test_a_steplog_folder_beside_the_steps_is_never_listed_as_a_step(base):
    tier = MemoryTier("job", node="n0", base=base)
    tier.save(2, state(2.0), wait=True)
    for name in ("steplog", "step-x", "step-0000000009"):       # a step log, junk, a step without its commit
        os.makedirs(os.path.join(tier.root, name, "data"), exist_ok=True)
        with open(os.path.join(tier.root, name, "data", "r00000.bin"), "wb") as f:
            f.write(b"not a checkpoint")
    assert tier.local_steps() == [2]
    got = state(0.0)
    assert tier.restore(got) == 2 and torch.equal(got["w"], state(2.0)["w"])
    assert tier.last_restore == {"step": 2, "files_from_peers": 0, "files_from_fallback": 0, "bytes_from_peers": 0}


def test_a_damaged_copy_is_refused_and_the_manager_falls_back_to_the_root(base, tmp_path):
    tier = MemoryTier("job", node="n0", base=base)
    root = str(tmp_path / "root")
    with CheckpointManager(root, every_steps=10, async_save=False, tiers=TierOptions(tier)) as mgr:
        for step in range(3):
            mgr.maybe_save(step, state(float(step)))
            tier.wait()
    data = [os.path.join(d, f) for d, _, fs in os.walk(tier.root) for f in fs if f.endswith(".bin")]
    with open(data[0], "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with pytest.raises(liferaft.CorruptCheckpointError):
        MemoryTier("job", node="n0", base=base).restore(state(0.0))
    got = state(-1.0)
    with CheckpointManager(root, tiers=TierOptions(MemoryTier("job", node="n0", base=base))) as mgr, \
            pytest.warns(UserWarning, match="memory tier could not be restored"):
        assert mgr.restore(got) == 0                       # the root's newest: step 0
    assert got["step"] == 0


def test_memory_every_auto_saves_by_time_and_release_frees_memory(base, tmp_path):
    tier = MemoryTier("job", node="n0", base=base, keep=2)
    with CheckpointManager(str(tmp_path / "root"), every_steps=1000, async_save=False,
                           save_policy=SavePolicy(mtbf_hours=1e-4),         # failures every 0.36 s: save often
                           tiers=TierOptions(tier, memory_every="auto")) as mgr:
        assert mgr.memory_interval_s is not None and mgr.memory_interval_s < 5
        for step in range(1, 4):
            mgr.maybe_save(step, state(float(step)))
            tier.wait()
            import time
            time.sleep(mgr.memory_interval_s + 0.01)
    assert tier.local_steps() == [2, 3]
    tier.release()
    assert not os.path.exists(tier.root)


def test_replica_targets_and_plans_are_pure():
    t = MemoryTier.__new__(MemoryTier)
    t.nodes, t.replicas = ["a", "a", "b", "b", "c", "c"], 2
    assert t.replica_targets(0) == [2, 4] and t.replica_targets(5) == [1, 3]
    for replicas, want in ((0, []), (1, [2]), (2, [2, 4]), (3, [2, 4]), (9, [2, 4])):   # never more than asked
        t.replicas = replicas                                # (replicas=0 used to copy to every other node)
        assert t.replica_targets(0) == want, replicas
    everyone = [{7: (("data/x/r0.bin", "data/x/r1.bin"), {"data/x/r0.bin": 10, "data/x/r1.bin": 10}, "m")},
                {}, {7: (("data/x/r0.bin", "data/x/r1.bin"), {"data/x/r1.bin": 10}, "m")}, {}]
    assert newest_complete(everyone) == (7, 0)
    need = ("data/x/r0.bin", "data/x/r1.bin", "data/x/r2.bin")
    assert file_holders(everyone, 7, need, {"data/x/r0.bin", "data/x/r1.bin"}) == {
        "data/x/r0.bin": [0], "data/x/r1.bin": [0, 2], "data/x/r2.bin": [0, 1, 2, 3]}   # r2: from a slower tier
    assert newest_complete([{7: (("f1", "f2"), {"f1": 1}, "m")}]) == (None, -1)


@pytest.mark.parametrize("size", [-1, 2 ** 63, 1.5, "12", None])
def test_a_transfer_announced_with_an_impossible_size_is_refused_before_anything_is_allocated(tmp_path, size):
    """Sizes in a transfer plan come from peers: a negative, huge or non-integer one is a DistributedError naming
    the file and the rank (a negative size used to make an empty replica silently)."""
    from liferaft.dist import Coordinator
    from liferaft.errors import DistributedError
    from liferaft.storage.posix import PosixStorage
    from liferaft.tiers.memory import transfer_files

    coord = Coordinator()
    coord.world = 2                      # (the check runs before any message: the world size is all it reads)
    with pytest.raises(DistributedError, match=r"r00001\.bin.*rank 1"):
        transfer_files(coord, PosixStorage(str(tmp_path)), [], [(1, "r00001.bin", size)], 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("job_id, node", [("..", "n0"), (".", "n0"), ("a\\b", "n0"), ("a\0b", "n0"),
                                          ("job", ".."), ("job", "../x"), ("job", "a/b")])
def test_job_and_node_names_that_leave_the_base_are_refused(tmp_path, job_id, node):
    # job id ".." made the tier's folder base/../<node>, and release() removed a folder outside the base (fuzzing)
    base = tmp_path / "shm"
    base.mkdir()
    victim = tmp_path / "n0"
    victim.mkdir()
    (victim / "precious.txt").write_text("x")
    with pytest.raises(liferaft.OptionsError):
        MemoryTier(job_id, node=node, base=str(base))
    assert (victim / "precious.txt").exists()
