"""The ``liferaft`` command: each subcommand on a small checkpoint, and the exit codes of failures."""

import numpy as np
import pytest
import torch

import liferaft
from liferaft.cli import main


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "layers": [torch.ones(2, dtype=torch.int64), (torch.tensor(1.5), "tag")],
        "step": 3,
        "sched": {"lr": 0.1, "milestones": [10, 20]},
        "arr": np.arange(4, dtype=np.int16),
        "blob": b"\x00\x01",
    }
    liferaft.save(str(path), state, options=liferaft.SaveOptions(metadata={"step": 3}))
    return path


def _data_file(path):
    files = sorted((path / "data").rglob("*.bin"))
    assert len(files) == 1
    return files[0]


def test_inspect(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "format v1" in out and "written by 1 rank(s)" in out
    lines = out.splitlines()                                  # a tree: model/ holds w (and b), layers/1/ holds 0
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("model/"))
    assert "2 key(s)" in lines[at] and lines[at + 1].split()[:3] == ["w", "float32", "[2,"]
    assert "whole" in lines[at + 1] and "raw" in lines[at + 1]
    assert any(ln.strip() == "1/" or ln.strip().startswith("1/ ") for ln in lines) and "step" in out
    assert 'metadata: {"step": 3}' in out
    assert main(["inspect", "--flat", str(ckpt)]) == 0
    flat = capsys.readouterr().out
    assert "model.w" in flat and "[2, 3]" in flat and "layers.1.0" in flat


def test_verify_ok(ckpt, capsys):
    assert main(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    # 4 tensors: model.w (24 B), model.b (8 B), layers.0 (16 B), layers.1.0 (4 B)
    assert out.startswith("OK ") and "4 chunk(s), 52 bytes verified" in out


def test_verify_detects_a_flipped_byte(ckpt, capsys):
    f = _data_file(ckpt)
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
    assert main(["verify", str(ckpt)]) == 1
    captured = capsys.readouterr()                              # the faults on stdout, one error line on stderr
    assert captured.out.startswith("FAILED ") and "checksum mismatch" in captured.out
    assert captured.err.startswith("liferaft verify: error:") and len(captured.err.strip().splitlines()) == 1


def test_verify_detects_a_truncated_file(ckpt, capsys):
    f = _data_file(ckpt)
    f.write_bytes(f.read_bytes()[:-1])
    assert main(["verify", str(ckpt)]) == 1
    captured = capsys.readouterr()
    assert "manifest says" in captured.out and len(captured.err.strip().splitlines()) == 1


def test_read_all_leaves(ckpt, capsys):
    assert main(["read", str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines}
    assert set(rows) == {"model.w", "model.b", "layers.0", "layers.1.0", "layers.1.1", "step", "sched", "arr",
                         "blob"}
    assert "tensor" in rows["model.w"] and "shape=[2, 3] dtype=float32" in rows["model.w"]
    assert "shape=[4] dtype=bfloat16" in rows["model.b"]
    assert "int" in rows["step"] and rows["step"].rstrip().endswith("3")
    assert "'tag'" in rows["layers.1.1"]
    # a dict of plain values is one leaf, shown by its repr
    assert "dict" in rows["sched"] and "'milestones': [10, 20]" in rows["sched"]
    assert "numpy" in rows["arr"] and "shape=[4] dtype=int16" in rows["arr"]
    assert "2 bytes" in rows["blob"]


def test_read_selected_keys(ckpt, capsys):
    assert main(["read", str(ckpt), "--key", "model", "--key", "step"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(keys) == ["model.b", "model.w", "step"]


def test_read_long_value_is_shortened(tmp_path, capsys):
    path = tmp_path / "c"
    liferaft.save(str(path), {"t": torch.zeros(1), "names": ["x" * 10] * 50})
    assert main(["read", str(path), "-k", "names"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("names") and line.endswith("...") and len(line) < 120


def test_read_unknown_key_fails(ckpt, capsys):
    assert main(["read", str(ckpt), "--key", "nope"]) == 1
    assert "'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify", "read"])
def test_missing_checkpoint_fails(tmp_path, capsys, command):
    assert main([command, str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"liferaft {command}: error:") and "no checkpoint" in err


def test_usage_errors(capsys):
    assert main([]) == 2
    assert main(["frobnicate", "x"]) == 2
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
