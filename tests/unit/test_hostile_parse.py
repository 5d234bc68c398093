"""liferaft's own on-disk parsers under hostile input (issue #16, classes 2 and 3): the strict JSON reader, the
manifest and commit marker (depth, NaN/Infinity, integer ranges, container kinds, times, enums), codec frames
(malformed headers, declared sizes beyond the chunk: refused before allocating) and a manager root's LEASE / PINS /
STARTS. Each mutation is written into a real checkpoint (re-sealing COMMIT: ``liferaft.testing.tamper``) and goes
through the public API and the CLI: a LiferaftError, a one-line CLI error, exit 1."""

from __future__ import annotations

import json
import os

import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.format.jsonsafe import json_depth, loads
from liferaft.format.limits import MAX_JSON_DEPTH
from liferaft.testing import tamper


def _state() -> dict:
    return {"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.int64)},
            "meta": {"step": 7, "lr": 0.5, "names": ["a", "b"], "pair": (1, 2)}}


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, _state())
    return path


def _refused_everywhere(path: str, capsys, match: str | None = None) -> None:
    """Every reading API call and CLI command refuses ``path`` with a LiferaftError (CLI: one line, exit 1)."""
    calls = [lambda: liferaft.load(path, _state()), lambda: liferaft.read(path), lambda: liferaft.inspect(path),
             lambda: liferaft.verify(path), lambda: liferaft.diff(path, path),
             lambda: liferaft.convert(path, path + ".st", to="safetensors")]
    for call in calls:
        with pytest.raises(LiferaftError, match=match):
            call()
    capsys.readouterr()
    for cmd in (["inspect", path], ["verify", path], ["read", path]):
        assert main(cmd) == 1, cmd
        err = capsys.readouterr().err.strip()
        assert err and "\n" not in err and "Traceback" not in err, (cmd, err)


# ------------------------------------------------------------------------------------------- the JSON reader


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                  b"[" * 200_000])
def test_deep_json_is_refused_before_parsing(data):
    with pytest.raises(CorruptCheckpointError, match="nested .* deep"):
        loads(data, "f.json", 1 << 30)


def test_depth_scan_ignores_brackets_in_strings_and_escapes():
    assert json_depth(b'["]]]", "[[[", "\\"[", {"a": ["\\\\"]}]') == 3
    assert json_depth(b'"' + b'[' * 1000 + b'"') == 0
    doc = json.dumps({"k": "[" * (MAX_JSON_DEPTH + 5)}).encode()
    assert loads(doc, "f", 1 << 20) == {"k": "[" * (MAX_JSON_DEPTH + 5)}


@pytest.mark.parametrize("data, what", [
    (b"[NaN]", "NaN"), (b'{"t": Infinity}', "Infinity"), (b"[-Infinity]", "Infinity"), (b"[1e400]", "overflows"),
    (b'{"a": 1, "a": 2}', "twice"), (b"\xff\xfe[]", "UTF-8"), ("[]".encode("utf-16"), "UTF-8"),
    (b"1" * 5000, "digits"), (b"[1, 2", "not valid JSON"), (b"", "not valid JSON"), (b"[] []", "not valid JSON")])
def test_strict_json_refuses(data, what):
    with pytest.raises(CorruptCheckpointError, match=what) as e:
        loads(data, "dir/f.json", 1 << 20)
    assert "dir/f.json" in str(e.value)


def test_size_cap_is_checked_first():
    with pytest.raises(CorruptCheckpointError, match="more than the 10"):
        loads(b"[" * 11, "f", 10)


# ------------------------------------------------------------------------------- manifests and commit markers


@pytest.mark.parametrize("data", [
    b'{"format":"liferaft","version":3,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"format":"liferaft","version":3,"created_unix":NaN}',
    b'{"format":"liferaft","version":3,"format":"liferaft"}',
    b"\x80not json"])
def test_hostile_manifest_bytes(ckpt, capsys, data):
    tamper.write_manifest_bytes(ckpt, data)
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("edit", [
    lambda m: m.update(manifest_size=float("nan")), lambda m: m.update(manifest_size=2 ** 64),
    lambda m: m.update(manifest_size=True), lambda m: m.update(manifest_size=-1), lambda m: [m],
    lambda m: m.update(version=1.5)])
def test_hostile_commit_marker(ckpt, capsys, edit):
    tamper.rewrite_marker(ckpt, edit)
    _refused_everywhere(ckpt, capsys)


def test_deep_commit_marker(ckpt, capsys):
    with open(os.path.join(ckpt, "COMMIT"), "wb") as f:
        f.write(b"[" * 100_000)
    _refused_everywhere(ckpt, capsys)


# ------------------------------------------------------------------------------- a manager root's own files


@pytest.fixture
def root(tmp_path):
    r = str(tmp_path / "root")
    with liferaft.CheckpointManager(r, async_save=False, preemption=liferaft.PreemptionOptions(signals=())) as m:
        m.save(1, _state())
        m.pin(1)
    return r


BAD_ROOT_FILES = [b"[" * 100_000, b"[NaN]", b"[Infinity]", b"\xff", b'{"a":', b"[1.5]", b"[true]", b"[-1]",
                  b"[18446744073709551616]", b'["1"]', b"{}", b"[[1]]"]


@pytest.mark.parametrize("data", BAD_ROOT_FILES)
def test_hostile_pins(root, capsys, data):
    with open(os.path.join(root, "PINS"), "wb") as f:
        f.write(data)
    with pytest.raises(CorruptCheckpointError, match="PINS.*delete it"):
        liferaft.gc(root, keep_last=1)
    assert [s.step for s in liferaft.ls(root)] == [1]                # ls still lists (no pins shown)
    capsys.readouterr()
    assert main(["gc", root, "--keep-last", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "PINS" in err and "\n" not in err
    assert main(["ls", root]) == 0


@pytest.mark.parametrize("data", BAD_ROOT_FILES + [b'{"job_id":"x","host":"h","pid":1e400,"renewed_unix":1}',
                                                   b'{"job_id":"x","host":"h","pid":5,"renewed_unix":NaN}',
                                                   b'{"job_id":"x","host":"h","pid":true,"renewed_unix":1}'])
def test_hostile_lease_and_starts_are_treated_as_absent(root, data):
    for name in ("LEASE", "STARTS"):
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
    with liferaft.CheckpointManager(root, async_save=False, preemption=liferaft.PreemptionOptions(signals=()),
                                    save_policy=liferaft.SavePolicy(every_seconds="auto")) as m:
        m.save(2, _state())
    starts = json.loads(open(os.path.join(root, "STARTS")).read()) if os.path.exists(
        os.path.join(root, "STARTS")) else []
    assert all(isinstance(x, float) for x in starts)
