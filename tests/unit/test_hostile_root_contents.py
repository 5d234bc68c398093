"""What a manager's root holds besides liferaft's own files, read as hostile input (a review with crafted roots,
helper-111): a LEASE naming a pid no system has, folders nested thousands deep, a user's file inside a step folder
that retention, gc or a rollback removes, a step number past 2**63, a rename whose replacement names a group the
pattern lacks. Each is a clear LiferaftError or handled — never a raw exception, never a deleted file liferaft did
not write."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.errors import OptionsError


def _root(tmp_path, steps=range(3)) -> str:
    root = str(tmp_path / "root")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        for s in steps:
            m.maybe_save(s, {"w": torch.full((4,), float(s))})
    return root


def _restore_and_save(root: str, restored: int, then: int) -> None:
    """A manager on ``root`` restores ``restored`` (the start's warnings about what it leaves ignored), saves
    ``then``."""
    st = {"w": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
            assert m.restore(st) == restored
            m.save(then, st)


@pytest.mark.parametrize("pid", [2 ** 31, 2 ** 40, 2 ** 63 - 1])
def test_a_lease_naming_a_pid_no_system_has_is_no_lease(tmp_path, pid):
    root = _root(tmp_path, [0])
    with open(os.path.join(root, "LEASE"), "w") as f:
        json.dump({"job_id": "x", "host": socket.gethostname(), "pid": pid, "renewed_unix": time.time(),
                   "ttl": 30}, f)
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        m.save(1, {"w": torch.ones(4)})
    r = liferaft_cli("gc", root, "--keep-last", "1", timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def _deep(folder: str, depth: int = 1200) -> None:
    os.makedirs(folder)
    fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(depth):                          # (relative to a descriptor: paths stay short)
            os.mkdir("a", dir_fd=fd)
            nxt = os.open("a", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def _remove_deep(folder: str) -> None:
    """Remove ``_deep``'s chain without recursion (pytest's own clean-up of old temporary folders recurses, as
    ``shutil.rmtree`` does: a chain left behind would break a later session): one level at a time, the folder's
    one child renamed up in its place."""
    spare = os.path.join(os.path.dirname(folder), ".deep-next")
    while os.path.isdir(folder):
        inner = os.path.join(folder, "a")
        deeper = os.path.isdir(inner)
        if deeper:
            os.rename(inner, spare)
        os.rmdir(folder)
        if not deeper:
            return
        os.rename(spare, folder)


def test_folders_nested_thousands_deep_under_a_root_block_nothing(tmp_path):
    root = _root(tmp_path, [0])
    deep = os.path.join(root, "step-0000000001")
    _deep(deep)
    try:
        assert [s.step for s in liferaft.ls(root) if s.status == "committed"] == [0]
        _restore_and_save(root, 0, 2)
        r = liferaft_cli("ls", root, timeout=120)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr
    finally:
        _remove_deep(deep)


def test_retention_gc_and_a_rollback_leave_a_users_file_in_a_step_folder(tmp_path):
    """Even where warnings are errors (a warning raised by the deletion would stop a rollback half way): what is
    left is a folder of the user's files (which the starts after leave, with their warning about such folders)."""
    warnings.simplefilter("error")
    root = _root(tmp_path)
    for s in (0, 1):
        with open(os.path.join(root, f"step-000000000{s}", "notes.txt"), "w") as f:
            f.write(f"mine {s}")
    report = liferaft.gc(root, keep_last=1)
    assert report.deleted == (0, 1)
    assert os.listdir(os.path.join(root, "step-0000000000")) == ["notes.txt"]
    for s in (0, 1):
        with open(os.path.join(root, f"step-000000000{s}", "notes.txt")) as f:
            assert f.read() == f"mine {s}"
    assert [i.step for i in liferaft.ls(root) if i.status == "committed"] == [2]
    for s in (0, 1):                                    # (the user tidies up: no folder of theirs left to warn of)
        shutil.rmtree(os.path.join(root, f"step-000000000{s}"))
    # a rollback: restore(step=K), then the next save removes the steps after K — not the user's file among them
    st = {"w": torch.zeros(4)}
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False, keep_last=2) as m:
        m.maybe_save(3, {"w": torch.full((4,), 3.0)})
        m.maybe_save(4, {"w": torch.full((4,), 4.0)})           # (retention drops 2: nothing of the user's there)
    for s in (3, 4):
        with open(os.path.join(root, f"step-000000000{s}", "notes.txt"), "w") as f:
            f.write(f"mine {s}")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        assert m.restore(st, step=3) == 3
        m.maybe_save(4, {"w": torch.full((4,), 44.0)})           # (the rollback removes the old 4 first)
    for s in (3, 4):
        with open(os.path.join(root, f"step-000000000{s}", "notes.txt")) as f:
            assert f.read() == f"mine {s}"
    st = {"w": torch.zeros(4)}
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        assert m.restore(st) == 4 and torch.equal(st["w"], torch.full((4,), 44.0))
    assert [i.step for i in liferaft.ls(root) if i.status == "committed"] == [3, 4]


def test_a_step_folder_numbered_past_2_63_is_no_step(tmp_path):
    root = _root(tmp_path, [0])
    liferaft.save(os.path.join(root, "step-99999999999999999999"), {"w": torch.ones(4)})
    assert 99999999999999999999 not in {i.step for i in liferaft.ls(root)}
    _restore_and_save(root, 0, 1)
    assert os.path.isdir(os.path.join(root, "step-99999999999999999999"))


def test_a_rename_whose_replacement_names_a_missing_group_is_an_options_error(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, {"w": torch.ones(2)})
    with pytest.raises(OptionsError, match="rename"):
        liferaft.convert(src, str(tmp_path / "x.pt"), to="torch", rename=[("(?P<a>w)", r"\g<b>")])
    for args in (["convert", src, str(tmp_path / "y.pt"), "--to", "torch"], ["diff", src, src]):
        r = liferaft_cli(*args, "--rename", "(?P<a>w)", r"\g<b>", timeout=120)
        # (a usage error: exit status 2, argparse's usage and one error line naming the pair; docs/API.md)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
        assert "--rename" in r.stderr.strip().splitlines()[-1], r.stderr
    for args in (["convert", src, str(tmp_path / "y.pt"), "--to", "torch"], ["diff", src, src]):
        r = liferaft_cli(*args, "--rename", "(", "x", timeout=120)     # a regex that does not compile (helper-113)
        assert r.returncode == 2 and "not a valid regular expression" in r.stderr.strip().splitlines()[-1], r.stderr


def test_gc_with_no_policy_is_an_error_and_deletes_nothing(tmp_path):
    """docs/cli/gc.md: no policy given is an error (helper-113: it deleted nothing and exited 0, after taking and
    releasing the root's lease); --incomplete alone is a policy (the leftovers of interrupted saves)."""
    root = str(tmp_path / "root")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        for s in range(3):
            m.maybe_save(s, {"w": torch.full((4,), float(s))})
    with pytest.raises(OptionsError, match="no policy"):
        liferaft.gc(root)
    r = liferaft_cli("gc", root, timeout=120)
    assert r.returncode == 1 and "no policy" in r.stderr, r.stderr
    assert sorted(os.listdir(root)).count("step-0000000000") == 1
    assert liferaft.gc(root, incomplete=True).deleted == ()


def test_gc_by_a_metric_no_step_records_deletes_nothing(tmp_path):
    root = str(tmp_path / "root")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        for s in range(3):
            m.maybe_save(s, {"w": torch.full((4,), float(s))}, metrics={"loss": 3.0 - s})
    with pytest.raises(OptionsError, match="'los'.*'loss'"):
        liferaft.gc(root, keep_best=1, metric="los")
    r = liferaft_cli("gc", root, "--keep-best", "1", "--metric", "los", timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert [i.step for i in liferaft.ls(root) if i.status == "committed"] == [0, 1, 2]
    assert liferaft.gc(root, keep_best=1, metric="loss").deleted == (0, 1)


def test_a_planted_shared_memory_name_with_a_pid_no_system_has_is_swept_not_fatal(tmp_path, monkeypatch):
    from liferaft.core.chunks import shm

    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))      # (the seam tests use: a folder of their own)
    planted = tmp_path / "liferaft-load-99999999999-0123456789abcdef-r0"
    planted.write_bytes(b"")
    os.utime(planted, (946684800, 946684800))
    shm.sweep_stale()
    assert not planted.exists()
