"""File-system shapes in place of a checkpoint's files (a few fixed cases: tests/unit holds the thorough
regressions): links to files outside the checkpoint, a FIFO, a directory, /dev/zero. The same property as the
fuzz targets (harness, props), with a planned example per case instead of drawn mutations."""

from __future__ import annotations

import os
import pickle

import fuzz_canary
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from props import Workspace
from test_pickled import planted

from liferaft.testing.tamper import read_manifest


def _data_file(w: Workspace) -> str:
    manifest, _ = read_manifest(w.src)
    own = [c["file"] for t in manifest["tensors"] for c in t["chunks"] if not c["file"].startswith("..")]
    return os.path.join(w.src, own[0])


def _replace(path: str, how: str, target: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        import shutil

        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if how == "link":
        os.symlink(target, path)
    elif how == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)


CASES = {
    # (seed, which file, what it becomes, what it points to)
    "data file links outside": ("native", "data", "link", "secret"),
    "data folder links outside": ("native", "data-dir", "link", "secret-dir"),
    "manifest is a FIFO": ("native", "manifest", "fifo", None),
    "COMMIT links to /dev/zero": ("native", "COMMIT", "link", "/dev/zero"),
    "COMMIT is a directory": ("native", "COMMIT", "dir", None),
    "data file is a directory": ("native", "data", "dir", None),
    "safetensors shard links outside": ("st-dir", "shard", "link", "secret"),
    "DCP shard links outside": ("dcp", "__0_0.distcp", "link", "secret"),
    "DCP .metadata is a FIFO": ("dcp", ".metadata", "fifo", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=2)
@given(data=st.data())
def test_fs_shape(seeds, call_timeout, case, data):
    seed, which, how, target = CASES[case]
    with Workspace(seeds[seed], call_timeout) as w:
        if which == "data":
            path = _data_file(w)
        elif which == "data-dir":
            path = os.path.dirname(_data_file(w))
        elif which == "manifest":
            path = os.path.join(w.src, read_manifest(w.src)[1])
        elif which == "shard":
            path = os.path.join(w.src, min(f for f in os.listdir(w.src) if f.endswith(".safetensors")))
        else:
            path = os.path.join(w.src, which)
        if target == "secret":
            with open(path, "rb") as src, open(w.secret, "wb") as dst:
                dst.write(src.read())             # the same bytes outside: only not following the link tells
        elif target == "secret-dir":
            import shutil

            shutil.copytree(path, os.path.join(os.path.dirname(w.secret), "d"))
            target = os.path.join(os.path.dirname(w.secret), "d")
        _replace(path, how, w.secret if target == "secret" else target)
        w.run(data, strict=True)


def test_canary_is_live():
    """The planted pickles do run code under an unrestricted unpickler (so the suite's canary can fail)."""
    try:
        for p in planted()[:3]:
            pickle.loads(p)
        assert fuzz_canary.fired() and os.path.exists(fuzz_canary.MARKER)
    finally:
        fuzz_canary.reset()


@pytest.mark.parametrize("damage", ["deep manifest", "planted DCP pickle", "truncated torch file"])
def test_cli_subprocess_sample(seeds, call_timeout, damage):
    """A sample of the CLI as users run it (``python -m liferaft``, a fresh process): exit 1, one line on stderr,
    no traceback, the canary untouched."""
    import subprocess
    import sys

    seed = {"deep manifest": "native", "planted DCP pickle": "dcp", "truncated torch file": "torch"}[damage]
    with Workspace(seeds[seed], call_timeout) as w:
        if damage == "deep manifest":
            from liferaft.testing.tamper import write_manifest_bytes

            write_manifest_bytes(w.src, b'{"a":' * 50_000 + b"1" + b"}" * 50_000)
        elif damage == "planted DCP pickle":
            with open(os.path.join(w.src, ".metadata"), "wb") as f:
                f.write(planted()[1])
        else:
            with open(w.src, "r+b") as f:
                f.truncate(os.path.getsize(w.src) // 2)
        cmds = {"deep manifest": ["inspect", w.src], "planted DCP pickle": ["read", w.src],
                "truncated torch file": ["convert", w.src, os.path.join(w.out, "c"), "--to", "liferaft"]}
        for cmd in [cmds[damage]]:            # one process each: a fresh interpreter costs seconds
            p = subprocess.run([sys.executable, "-m", "liferaft", *cmd], capture_output=True, text=True,
                               timeout=60 + call_timeout)
            assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, \
                f"liferaft {cmd[0]}: exit {p.returncode}, stderr {p.stderr[-500:]!r}"
        assert not fuzz_canary.fired(), fuzz_canary.what()
