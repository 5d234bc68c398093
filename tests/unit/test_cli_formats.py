"""Every command that takes a checkpoint takes every format liferaft reads — liferaft, a DCP folder (written by
torch's own ``dcp.save``), a safetensors file and folder, a ``torch.save`` file — and the two that take a manager
root say clearly when given a checkpoint. Table-driven: one row per (format, command)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import liferaft
from liferaft import JobOptions
from liferaft.cli import main

safetensors = pytest.importorskip("safetensors.torch")

FORMATS = ["liferaft", "dcp", "safetensors-file", "safetensors-folder", "torch"]


def _model_state():
    g = torch.Generator().manual_seed(0)
    return {"emb.weight": torch.randn(40, 8, generator=g), "head.weight": torch.randn(4, 8, generator=g),
            "head.bias": torch.zeros(4)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same model (and, where the format holds them, an optimizer's state and a step) in each format."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    root = tmp_path_factory.mktemp("formats")
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    paths = {f: str(root / f) for f in FORMATS}
    liferaft.save(paths["liferaft"], {"model": model, "optim": opt, "step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": 1},
                 checkpoint_id=paths["dcp"], no_dist=True)
    paths["safetensors-file"] += ".safetensors"
    safetensors.save_file(_model_state(), paths["safetensors-file"])
    os.makedirs(paths["safetensors-folder"])
    safetensors.save_file(_model_state(), os.path.join(paths["safetensors-folder"], "model.safetensors"))
    paths["torch"] += ".pt"
    torch.save({"model": model.state_dict(), "step": 1}, paths["torch"])
    return paths


# (command line after the checkpoint, what the output must hold); {fmt} is replaced by the format's report name
COMMANDS = {
    "inspect": ([], "tensors"),
    "inspect --flat": (["--flat"], "tensors"),
    "inspect KEY --stats": (["*", "--stats"], "min"),
    "inspect --json": (["--json"], '"dtype"'),
    "verify": ([], ""),
    "verify --json": (["--json"], '"ok": true'),
    "read": ([], "tensor"),
    "read --json": (["--json"], '"type": "tensor"'),
    "diff (itself)": (None, "identical"),
    "convert --to liferaft": (None, "→ liferaft"),
    "convert --to dcp": (None, "→ dcp"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_command_takes_every_format(checkpoints, fmt, command, tmp_path, capsys):
    path = checkpoints[fmt]
    extra, expect = COMMANDS[command]
    verb = command.split()[0]
    if command.startswith("diff"):
        argv = ["diff", path, path]
    elif command.startswith("convert"):
        to = command.split()[-1]
        if fmt == to:
            pytest.skip("nothing to convert")
        argv = ["convert", path, str(tmp_path / "out"), "--to", to]
    else:
        argv = [verb, path, *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{argv}: {err}"
    assert expect in out, out
    assert "COMMIT" not in out + err and "not a checkpoint" not in out + err


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_shows_the_same_leaves_in_every_format(checkpoints, fmt, capsys):
    assert main(["read", checkpoints[fmt], "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    weight = next(k for k in rows if k.endswith("weight") and "exp_avg" not in k)
    assert rows[weight]["type"] == "tensor" and "dtype=float32" in rows[weight]["details"]
    if fmt in ("liferaft", "dcp", "torch"):
        assert rows["step"]["type"] == "int" and rows["step"]["details"] == "1"
    assert main(["read", checkpoints[fmt], "--key", "nope"]) == 1
    assert "'nope'" in capsys.readouterr().err


def test_verify_checks_the_crcs_of_dcp_and_torch_files_and_says_what_it_cannot(checkpoints, tmp_path, capsys):
    import shutil

    assert main(["verify", checkpoints["dcp"]]) == 0
    assert "checked against their CRC-32" in capsys.readouterr().out
    assert main(["verify", checkpoints["safetensors-folder"]]) == 0
    assert "NOT verified" in capsys.readouterr().out            # no checksums in that format: it says so
    bad = str(tmp_path / "dcp")
    shutil.copytree(checkpoints["dcp"], bad)
    data = os.path.join(bad, next(n for n in os.listdir(bad) if n.endswith(".distcp")))
    raw = bytearray(open(data, "rb").read())
    from liferaft.formats.dcp import DcpCheckpoint

    chunk = DcpCheckpoint(bad).tensors["model.weight"].chunks[0]
    raw[chunk.offset + chunk.length - 40] ^= 0xFF               # inside the archive's data record
    open(data, "wb").write(bytes(raw))
    assert main(["verify", bad]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("FAILED") and len(err.strip().splitlines()) == 1
    pt = str(tmp_path / "bad.pt")
    raw = bytearray(open(checkpoints["torch"], "rb").read())
    raw[_record_data(checkpoints["torch"], "/data/0")] ^= 0xFF    # the first byte of a tensor's record
    open(pt, "wb").write(bytes(raw))
    assert main(["verify", pt, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    st = str(tmp_path / "short.safetensors")
    open(st, "wb").write(open(checkpoints["safetensors-file"], "rb").read()[:-8])
    assert main(["verify", st]) == 1
    assert "truncated" in capsys.readouterr().out


def _record_data(path, suffix):
    """Where the bytes of the zip record whose name ends with ``suffix`` start in the file."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    n, m = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + n + m


def test_ls_and_gc_take_a_root_and_say_so_when_given_a_checkpoint(checkpoints, capsys):
    for fmt in FORMATS:
        for argv in (["ls", checkpoints[fmt]], ["gc", checkpoints[fmt], "--keep-last", "1", "--dry-run"]):
            assert main(argv) == 1, argv
            err = capsys.readouterr().err
            assert "not a CheckpointManager root" in err and len(err.strip().splitlines()) == 1


def test_a_root_with_step_folders_of_another_format_lists_them_as_that_and_gc_leaves_them(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "run")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False, job=JobOptions(job_id="job")) as mgr:
        for step in range(3):
            mgr.maybe_save(step, {"w": torch.full((4,), float(step)), "step": step})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=os.path.join(root, "step-10"), no_dist=True)  # torchtitan's names
    assert main(["ls", root, "--json"]) == 0
    doc = {d["step"]: d for d in json.loads(capsys.readouterr().out)}
    assert doc[10]["status"] == "dcp" and "not written by liferaft" in doc[10]["reason"]
    assert main(["gc", root, "--keep-last", "1", "--incomplete", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == [0, 1]
    assert os.path.isfile(os.path.join(root, "step-10", ".metadata"))
    assert main(["read", os.path.join(root, "step-10")]) == 0
