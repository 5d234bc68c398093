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

import liferaft
from liferaft import CorruptCheckpointError

BOMB_BYTES = 768 << 20                              # what the compressed record inflates to


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "liferaft", *args], capture_output=True, text=True, timeout=300)


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
