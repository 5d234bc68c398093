"""A manager with tiers asks the memory tier first: when it holds a complete step at least as new as every step the
manager began to save to the root or the remote tier (the nodes' marks, ``tiers.marks``), the restore loads it
without listing either — on an object store a LIST walks every key, and it blocked the restart before memory was
asked. Without a usable mark, or with a slower tier holding a newer step, the restore lists and picks exactly what it
picked before. A mark is hostile bytes like any other file."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch

from liferaft import CheckpointManager, JobOptions, PreemptionOptions, TierOptions
from liferaft.tiers import marks
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
    mark removed the same restore lists the remote tier first."""
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
        os.remove(os.path.join(shm, "job", "n0", marks.mark_name(root.url)))
        seen = len(proxy.requests)
        with CheckpointManager(root, preemption=NO_SIGNALS, job=JobOptions(lease_ttl=30.0), tiers=tiers) as mgr:
            assert mgr.restore(got) == 5
        assert any("list-type" in r.path and "remote%2F" in r.path for r in proxy.requests[seen:])


def test_a_newer_step_on_the_root_is_still_found(tmp_path, shm):
    """Saves straight to the root (drain=False) raise the mark past the memory tier's newest: the restore lists the
    root and loads its newer step."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])
    assert marks.read_mark(os.path.join(shm, "job", "n0"), _url(root)) == 4


def _url(root: str) -> str:
    with CheckpointManager(root, preemption=NO_SIGNALS) as mgr:
        return mgr.storage.url


def _mark_path(shm: str, root: str) -> str:
    return os.path.join(shm, "job", "n0", marks.mark_name(_url(root)))


@pytest.mark.parametrize("plant", ["garbage", "other-owner", "low-step", "symlink", "fifo", "folder", "huge",
                                   "negative", "removed"])
def test_a_mark_that_does_not_hold_makes_the_restore_list(tmp_path, shm, plant):
    """Whatever sits where the mark belongs, a restore still finds the root's newer step (a mark only ever saves a
    listing) and never blocks on it. A mark lower than the truth is the one case a mark cannot catch; the node's
    memory-tier folder is the job's own (docs/TIERS.md)."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    path = _mark_path(shm, root)
    os.remove(path)
    url = _url(root)
    if plant == "garbage":
        open(path, "wb").write(b"\xff{not json")
    elif plant == "other-owner":
        open(path, "w").write('{"format": 1, "owner": "file:///elsewhere", "step": 1}')
    elif plant == "low-step":
        open(path, "w").write(f'{{"format": 1, "owner": "{url}", "step": 2.5}}')
    elif plant == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text(f'{{"format": 1, "owner": "{url}", "step": 1}}')
        os.symlink(target, path)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "folder":
        os.mkdir(path)
    elif plant == "huge":
        open(path, "w").write(f'{{"format": 1, "owner": "{url}", "step": 1, "pad": "{"x" * (70 << 10)}"}}')
    elif plant == "negative":
        open(path, "w").write(f'{{"format": 1, "owner": "{url}", "step": -1}}')
    assert marks.read_mark(os.path.dirname(path), url) is None
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 4 and torch.equal(got["w"], _state(4.0)["w"])


def test_the_mark_never_goes_down(tmp_path, shm):
    """A restore of an older step that then saves leaves the newer steps under the root: the mark keeps the newest,
    so a later restore lists them (and picks what it picked before marks existed)."""
    root = str(tmp_path / "root")
    _run(root, shm, range(7), memory_every=1)                          # root: 0 2 4 6 (drained), memory: 6
    path = _mark_path(shm, root)
    with CheckpointManager(root, preemption=NO_SIGNALS, async_save=False,
                           tiers=TierOptions(_tier(shm))) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got, step=2) == 2
        mgr.save(3, _state(3.0))
    assert '"step": 6' in open(path).read()


def test_a_mark_that_cannot_be_written_is_no_mark(tmp_path, shm):
    """A folder (with a file in it) where the mark belongs: it can be neither replaced nor removed, and reads as no
    mark, so the save goes on and the next restore lists the root and finds the step saved after it."""
    root = str(tmp_path / "root")
    _run(root, shm, range(5), drain=False, memory_every=3)            # memory: 3; root: 0 2 4
    path = _mark_path(shm, root)
    os.remove(path)
    os.mkdir(path)
    open(os.path.join(path, "x"), "w").close()
    with CheckpointManager(root, preemption=NO_SIGNALS, async_save=False, tiers=TierOptions(_tier(shm), drain=False),
                           job=JobOptions(lease_ttl=30.0)) as mgr:
        mgr.save(8, _state(8.0))
    assert os.path.isdir(path)
    with CheckpointManager(root, preemption=NO_SIGNALS, tiers=TierOptions(_tier(shm), drain=False)) as mgr:
        got = _state(-1.0)
        assert mgr.restore(got) == 8 and torch.equal(got["w"], _state(8.0)["w"])


def test_every_node_lost_lists_the_root(tmp_path, shm):
    """No memory left (and no marks with it): the root's newest step, as before."""
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
