"""Hostile review G (the save's life on disk), each finding as a class of input: a save into a folder holding a
user's files deleted them; two saves to one path at once (two processes, or two threads) both returned success
while the checkpoint they committed had lost its data or held the other's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import liferaft
from liferaft.errors import CheckpointBusyError, LiferaftError


def test_a_save_into_a_folder_never_deletes_files_liferaft_did_not_write(tmp_path):
    folder = tmp_path / "project"
    mine = {"data/train.csv": b"a,b\n", "data/images/cat.png": b"\x89PNG", "manifest-of-my-dataset.json": b"{}",
            "notes.tmp-draft.txt": b"todo", "data/0123456789abcdef/notes.txt": b"x",
            "manifest-0123456789abcdef.json.bak": b"{}"}
    for name, data in mine.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for overwrite in (False, True, True):
        liferaft.save(str(folder), {"w": torch.ones(4)}, options=liferaft.SaveOptions(overwrite=overwrite))
    for name, data in mine.items():
        assert (folder / name).read_bytes() == data, name
    # (the replaced saves' own files went: one manifest and one data folder besides the user's are left)
    assert len([n for n in os.listdir(folder) if n.startswith("manifest-") and n.endswith(".json")
                and len(n) == len("manifest-0123456789abcdef.json")]) == 1
    assert torch.equal(liferaft.read(str(folder))["w"], torch.ones(4))


HOLDER = """
import sys, time
from liferaft.storage import resolve
release = resolve(sys.argv[1]).lock_writer()
print("held", flush=True)
sys.stdin.readline()
release()
"""


def test_a_save_to_a_path_another_save_holds_is_refused_and_leaves_it_alone(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.zeros(8)})
    before = sorted(os.listdir(path))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for call in (lambda: liferaft.save(path, {"w": torch.ones(8)}, options=liferaft.SaveOptions(overwrite=True)),
                     lambda: liferaft.async_save(path, {"w": torch.ones(8)},
                                                 options=liferaft.SaveOptions(overwrite=True)).wait()):
            with pytest.raises(CheckpointBusyError, match="another save to this folder is in progress"):
                call()
        assert sorted(os.listdir(path)) == before
    finally:
        holder.communicate("go\n", timeout=60)
    liferaft.save(path, {"w": torch.ones(8)}, options=liferaft.SaveOptions(overwrite=True))   # free again
    assert torch.equal(liferaft.read(path)["w"], torch.ones(8))
    fresh = str(tmp_path / "new")                                # a refused save leaves no folder behind
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, fresh], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointBusyError):
            liferaft.save(fresh, {"w": torch.ones(8)})
    finally:
        holder.communicate("go\n", timeout=60)
    assert not os.path.exists(fresh)


RACER = """
import json, os, sys, time, torch, liferaft
root, until = sys.argv[1], time.time() + float(sys.argv[2])
state, bad, ok = {"w": torch.randn(1 << 20)}, 0, 0
while time.time() < until:
    try:
        r = liferaft.save(root, state, options=liferaft.SaveOptions(overwrite=True))
    except liferaft.errors.CheckpointBusyError:
        continue
    try:
        named = json.load(open(root + "/COMMIT"))["manifest"] == f"manifest-{r.save_id}.json"
    except (OSError, ValueError):
        continue
    if named and not os.path.exists(f"{root}/data/{r.save_id}/r00000.bin"):
        bad += 1
    else:
        ok += 1
print(ok, bad)
"""


def test_two_processes_saving_to_one_path_never_commit_a_checkpoint_without_its_data(tmp_path):
    root = str(tmp_path / "ck")
    procs = [subprocess.Popen([sys.executable, "-c", RACER, root, "4"], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [tuple(map(int, p.communicate(timeout=120)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert sum(ok for ok, _ in results) > 0 and all(bad == 0 for _, bad in results), results
    liferaft.verify(root)
    assert json.load(open(os.path.join(root, "COMMIT")))["manifest"].startswith("manifest-")


def test_two_threads_saving_at_once_never_mix_their_bytes(tmp_path):
    big = {"t": torch.full((4 << 20,), 1.0)}
    small = {"t": torch.full((1 << 16,), 2.0)}
    for it in range(4):
        done, raw = [], []
        bar = threading.Barrier(2)

        def one(path=str(tmp_path / f"a{it}")):
            bar.wait()
            try:
                liferaft.async_save(path, big).wait()
                done.append((path, 1.0))
            except LiferaftError:
                pass
            except Exception as e:  # noqa: BLE001 - collected: the test fails on any
                raw.append(e)

        def other(it=it):
            bar.wait()
            for j in range(3):
                try:
                    liferaft.save(str(tmp_path / f"b{it}-{j}"), small)
                    done.append((str(tmp_path / f"b{it}-{j}"), 2.0))
                except LiferaftError:
                    pass
                except Exception as e:  # noqa: BLE001
                    raw.append(e)

        threads = [threading.Thread(target=f) for f in (one, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not raw, raw
        for path, value in done:
            liferaft.verify(path)
            assert bool((liferaft.read(path)["t"] == value).all()), path


def test_an_incremental_save_whose_base_changed_meanwhile_commits_nothing(tmp_path):
    from liferaft.core.commit import open_checkpoint, write_commit
    from liferaft.storage import resolve

    root = tmp_path / "run"
    liferaft.save(str(root / "A"), {"w": torch.ones(1 << 16)})
    liferaft.save(str(root / "B"), {"w": torch.ones(1 << 16)}, options=liferaft.SaveOptions(incremental_base="A"))
    manifest = open_checkpoint(resolve(str(root / "B")))           # what B's commit wrote, referencing A's files
    assert any(f.startswith("../A/") for f in manifest.files)
    # the same commit once A was replaced (as by another save while B's ran): refused, nothing committed
    liferaft.save(str(root / "A"), {"w": torch.zeros(1 << 16)}, options=liferaft.SaveOptions(overwrite=True))
    (root / "C").mkdir()
    with pytest.raises(CheckpointBusyError, match="changed while it ran"):
        write_commit(resolve(str(root / "C")), "0123456789abcdef", manifest)
    assert os.listdir(root / "C") == []
    with pytest.raises(liferaft.errors.LiferaftError, match="replaced since this incremental checkpoint was saved"):
        liferaft.verify(str(root / "B"))


def test_a_commit_under_a_root_whose_lease_another_job_took_is_refused(tmp_path):
    """A job frozen past its lease's ttl (SIGSTOP, a stalled host) while its save runs: the job that took the root
    over meanwhile is not overwritten; the commit checks the lease right before its marker (guard_commits)."""
    from liferaft.core.commit import guard_commits
    from liferaft.manager.lease import Lease
    from liferaft.storage import resolve

    root = str(tmp_path / "run")
    mgr = liferaft.CheckpointManager(root, every_steps=1, async_save=False,
                                     job=liferaft.JobOptions(job_id="job-a", lease_ttl=1.0),
                                     preemption=liferaft.PreemptionOptions(signals=()))
    try:
        mgr.save(0, {"w": torch.zeros(4)})
        lease = mgr._lease
        assert lease is not None
        lease._stop.set()                   # frozen: it renews no more
        lease._thread.join()
        other = Lease(resolve(root), "job-b", ttl=30.0)
        other.acquire()                     # (after the frozen job's lease went stale)
        try:
            with pytest.raises(CheckpointBusyError, match="job-b"):
                liferaft.save(os.path.join(root, "step-0000000001"), {"w": torch.ones(4)})
            assert not os.path.exists(os.path.join(root, "step-0000000001", "COMMIT"))
        finally:
            other.release()
    finally:
        mgr.close()
    stop = guard_commits(root, lambda: None)       # a guard removed is no longer run
    stop()
    liferaft.save(os.path.join(root, "step-0000000002"), {"w": torch.ones(4)})


def test_a_lease_renewal_that_failed_once_does_not_stop_later_saves(tmp_path):
    import time

    from liferaft.manager.lease import Lease
    from liferaft.testing.faults import FlakyStorage

    lease = Lease(FlakyStorage(str(tmp_path / "run")), "job-a", ttl=1.0)
    lease.acquire()
    try:
        FlakyStorage.match, FlakyStorage.failures = "LEASE", 1         # the next renewal fails, once
        deadline = time.monotonic() + 30
        while FlakyStorage.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)                                                # (renewals every ttl / 3 go on)
        lease.check()                                                  # a later renewal succeeded: no error
    finally:
        FlakyStorage.failures = 0
        lease.release()


def test_a_save_with_if_busy_skip_or_raise_does_not_wait_for_another_threads_save(tmp_path):
    import time

    class Slow:
        def state_dict(self):
            time.sleep(1.5)
            return {"x": 1}

        def load_state_dict(self, sd):
            pass

    first = threading.Thread(target=liferaft.save, args=(str(tmp_path / "a"), {"slow": Slow()}))
    first.start()
    time.sleep(0.3)
    try:
        t0 = time.monotonic()
        assert liferaft.save(str(tmp_path / "b"), {"w": torch.ones(2)},
                             options=liferaft.SaveOptions(if_busy="skip")) is None
        with pytest.raises(CheckpointBusyError, match="another thread"):
            liferaft.save(str(tmp_path / "b"), {"w": torch.ones(2)}, options=liferaft.SaveOptions(if_busy="raise"))
        assert time.monotonic() - t0 < 1.0 and first.is_alive()
    finally:
        first.join(60)
    liferaft.save(str(tmp_path / "b"), {"w": torch.ones(2)})              # (waits, then saves)
