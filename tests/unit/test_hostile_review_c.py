"""Hostile review C of issue #16, each finding as a class: a compressed zip record inside a checkpoint file (a
memory bomb ``verify`` must never inflate), one bad entry of a manager root hiding or blocking the rest, steps
named other than canonically, and ``plan --costs`` of a folder. Real files, real processes (the S3 findings are in
test_s3.py, next to the moto server)."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft import CorruptCheckpointError

BOMB_BYTES = 768 << 20                              # what the compressed record inflates to


def cli(*args: str) -> subprocess.CompletedProcess:
    return liferaft_cli(*args, timeout=300)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A ``torch.save`` archive of ``{"w": arange(4)}`` with one more record of ~1 KiB: bzip2 inflating to
    BOMB_BYTES zeros."""
    plain, buf, piece = io.BytesIO(), io.BytesIO(), b"\0" * (64 << 20)
    torch.save({"w": torch.arange(4.0)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(buf, "w") as z:
        for i in src.infolist():
            z.writestr(i, src.read(i))
        info = zipfile.ZipInfo(src.namelist()[0].split("/")[0] + "/zz")
        info.compress_type = zipfile.ZIP_BZIP2
        with z.open(info, "w", force_zip64=True) as w:
            for _ in range(BOMB_BYTES // len(piece)):
                w.write(piece)
    return buf.getvalue()


_UNDER_CAP = textwrap.dedent("""
    import resource, sys
    import liferaft
    from liferaft.core.read import check
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    cap = size + (384 << 20)                        # half of what the record inflates to
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        r = check(sys.argv[1])
        print("REPORT", r.bytes_read, "|".join(r.faults))
    except liferaft.LiferaftError as e:
        print("REFUSED", type(e).__name__, e)
""")


def _checked_under_cap(path: str) -> str:
    r = subprocess.run([sys.executable, "-c", _UNDER_CAP, path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "MemoryError" not in r.stderr + r.stdout, r.stderr[-2000:]
    return r.stdout


def _dcp_with_bomb(folder: str, bomb: bytes) -> None:
    """A DCP checkpoint whose value blob of ``step.a`` is the zip archive ``bomb`` (appended to its file)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(8.0), "step": {"a": 5}}, checkpoint_id=folder, no_dist=True)
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        md = pickle.load(f)                         # written just above by DCP itself
    for idx, info in list(md.storage_data.items()):
        if idx.fqn == "step.a":
            path = os.path.join(folder, info.relative_path)
            offset = os.path.getsize(path)
            with open(path, "ab") as f:
                f.write(bomb)
            md.storage_data[idx] = type(info)(relative_path=info.relative_path, offset=offset, length=len(bomb))
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_of_a_dcp_blob_never_inflates_a_compressed_record(tmp_path, bomb):
    folder = str(tmp_path / "dcp")
    _dcp_with_bomb(folder, bomb)
    out = _checked_under_cap(folder)
    assert out.startswith("REPORT") and "is compressed" in out and "'archive/zz'" in out, out
    assert int(out.split()[1]) < 1 << 20, out       # nothing inflated: the bytes read are the file's own
    with pytest.raises(CorruptCheckpointError, match=r"archive/zz.*compressed"):
        liferaft.verify(folder)
    r = cli("verify", folder)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "compressed" in r.stdout + r.stderr


def test_verify_of_a_torch_file_never_inflates_a_compressed_record(tmp_path, bomb):
    path = tmp_path / "bomb.pt"
    path.write_bytes(bomb)
    out = _checked_under_cap(str(path))
    assert "compressed" in out and "/zz" in out, out
    assert not out.startswith("REPORT") or int(out.split()[1]) < 1 << 20, out
    r = cli("verify", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "compressed" in r.stdout + r.stderr


def _root(tmp_path, steps=range(2)) -> str:
    root = str(tmp_path / "root")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        for s in steps:
            m.maybe_save(s, {"w": torch.full((4,), float(s)), "step": s})
    return root


def test_one_bad_foreign_looking_step_never_blocks_ls_or_gc_of_the_root(tmp_path):
    root, outside = _root(tmp_path), tmp_path / "outside.txt"
    outside.write_text("precious")
    os.makedirs(f"{root}/step-0000000011")
    os.mkfifo(f"{root}/step-0000000011/.metadata")                      # a DCP folder's metadata, a FIFO
    os.makedirs(f"{root}/step-0000000012")
    os.symlink(outside, f"{root}/step-0000000012/model.safetensors")    # safetensors, a link outside
    steps = {i.step: i for i in liferaft.ls(root)}
    assert steps[0].status == steps[1].status == "committed"
    assert steps[11].status == "corrupt" and "FIFO" in steps[11].reason and "step-0000000011" in steps[11].reason
    assert steps[12].status == "corrupt" and "link" in steps[12].reason
    r = cli("ls", root)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "committed" in r.stdout and "FIFO" in r.stdout
    r = cli("ls", "--verify", root)                 # corrupt steps listed: exit 1, every step listed
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout.count("committed") == 2
    r = cli("gc", "--incomplete", "--keep-last", "1", root)
    assert r.returncode == 0 and "deleted 1 step(s) [0]" in r.stdout, r.stdout + r.stderr
    assert sorted(set(os.listdir(root)) - {"INTENT"}) == ["step-0000000001", "step-0000000011", "step-0000000012"]
    assert outside.read_text() == "precious"


def test_steps_are_only_canonical_folders_and_gc_reports_only_what_it_removed(tmp_path):
    root, outside = _root(tmp_path, range(3)), tmp_path / "outside"
    os.makedirs(outside / "dir")
    (outside / "victim").write_text("precious")
    (outside / "dir" / "x").write_text("x")
    os.symlink(outside / "dir", f"{root}/step-0000000000/dirlink")      # a link to a folder inside a doomed step
    os.symlink(outside / "victim", f"{root}/step-0000000000/data/filelink")
    os.symlink(outside, f"{root}/step-0000000007")                      # step entries that are not folders
    os.mkfifo(f"{root}/step-0000000008")
    with open(f"{root}/step-0000000009", "w") as f:
        f.write("a file")
    os.makedirs(f"{root}/step-5/data")                                  # not a canonical name
    for name in os.listdir(f"{root}/step-0000000002"):
        if name != "data":
            with open(f"{root}/step-0000000002/{name}", "rb") as src, open(f"{root}/step-5/{name}", "wb") as dst:
                dst.write(src.read())
    steps = {i.step: i for i in liferaft.ls(root)}
    assert [steps[s].status for s in (0, 1, 2)] == ["committed"] * 3
    for s in (7, 8, 9):
        assert steps[s].status == "corrupt" and "not a folder" in steps[s].reason, steps[s]
    assert steps[5].status == "corrupt" and "step-0000000005" in steps[5].reason
    report = liferaft.gc(root, keep_last=1, incomplete=True)
    assert report.deleted == (0, 1) and report.kept == (2,)
    r = cli("gc", "--keep-last", "1", "--incomplete", root)           # nothing left that it may delete
    assert r.returncode == 0 and "deleted 0 step(s) []" in r.stdout, r.stdout + r.stderr
    # (the links planted in step 0 are no names liferaft writes: they stay, unfollowed; the rest of it went)
    assert sorted(set(os.listdir(root)) - {"INTENT"}) == ["step-0000000000", "step-0000000002", "step-0000000007",
                                                          "step-0000000008", "step-0000000009", "step-5"]
    assert sorted(os.listdir(f"{root}/step-0000000000")) == ["data", "dirlink"]
    assert os.listdir(f"{root}/step-0000000000/data") == ["filelink"]
    assert sorted(os.listdir(outside)) == ["dir", "victim"] and os.listdir(outside / "dir") == ["x"]
    assert (outside / "victim").read_text() == "precious"
    with pytest.warns(UserWarning, match="not a folder"), \
            liferaft.CheckpointManager(root, every_steps=1, async_save=False) as m:
        assert m.restore({"w": torch.zeros(4), "step": 0}) == 2


def test_plan_costs_of_a_folder_names_the_folder(tmp_path):
    r = cli("plan", "--costs", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr and str(tmp_path) in r.stderr
    assert "Errno" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
