"""Hostile Hugging Face folders and safetensors files: every one ends in one clear ``LiferaftError`` within seconds
(a FIFO or a device never hangs a reader: those cases run the CLI in a subprocess with a timeout), nothing is read
from or written outside the folders involved — and the layouts that are meant to work (the hub cache's links into
``blobs/``, an output folder that is a link) still do."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.cli import main
from liferaft.core.open import open_reader as open_source
from liferaft.core.read import check as check_source

safetensors = pytest.importorskip("safetensors.torch")


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """The CLI in a subprocess: a hang fails the test (TimeoutExpired) instead of hanging the suite."""
    return liferaft_cli(*args, timeout=timeout)


def one_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The CLI failed with one error line (no traceback) that holds ``words``."""
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert all(w in err[0] for w in words), err[0]
    return err[0]


class M(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


def _resign(ck: str, fn) -> None:
    """Apply ``fn`` to the manifest of liferaft checkpoint ``ck`` and pin the result in its COMMIT marker."""
    from liferaft.codecs.checksum import digest

    commit = json.load(open(os.path.join(ck, "COMMIT")))
    path = os.path.join(ck, commit["manifest"])
    doc = json.load(open(path))
    fn(doc)
    data = json.dumps(doc).encode()
    open(path, "wb").write(data)
    commit["manifest_size"], commit["manifest_hash"] = len(data), digest(data)
    open(os.path.join(ck, "COMMIT"), "w").write(json.dumps(commit))


def _hf_source(d: str) -> str:
    os.makedirs(d)
    safetensors.save_file({"x": torch.ones(2)}, os.path.join(d, "model.safetensors"))
    open(os.path.join(d, "config.json"), "w").write("{}")
    return d


# --------------------------------------------------------------------------- (2) FIFOs and devices in HF folders


def test_a_config_folder_holding_a_fifo_or_a_device_is_refused_without_hanging(tmp_path):
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"model": M()})
    for name, make in (("fifo", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p))):
        cfg = tmp_path / f"cfg_{name}"
        cfg.mkdir()
        (cfg / "config.json").write_text('{"a": 1}')
        make(str(cfg / "tokenizer.json"))
        r = cli("convert", ck, str(tmp_path / f"out_{name}"), "--to", "hf", "--config", str(cfg))
        one_error(r, "tokenizer.json", "FIFO" if name == "fifo" else "device", "not a regular file")
        assert not os.path.exists(tmp_path / f"out_{name}" / "model.safetensors")     # refused before writing


def test_an_import_of_a_folder_holding_a_fifo_a_device_or_a_link_outside_is_refused(tmp_path):
    (tmp_path / "secret.txt").write_text("PRIVATE KEY\n")
    for name, make in (("fifo", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p)),
                       ("secret", lambda p: os.symlink(str(tmp_path / "secret.txt"), p))):
        src = _hf_source(str(tmp_path / f"src_{name}"))
        make(os.path.join(src, "tokenizer.json"))
        r = cli("convert", src, str(tmp_path / f"ck_{name}"), "--to", "liferaft")
        one_error(r, "tokenizer.json", {"fifo": "FIFO", "zero": "device", "secret": "outside its folder"}[name])
        assert not os.path.exists(tmp_path / f"ck_{name}")
    with pytest.raises(liferaft.CorruptCheckpointError, match="outside its folder"):
        liferaft.convert(str(tmp_path / "src_secret"), str(tmp_path / "ck"), "liferaft")


# --------------------------------------------------------------------------- (3) a safetensors index


def _indexed(d, weight_map, raw: str | None = None) -> str:
    os.makedirs(d)
    text = raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    open(os.path.join(d, "model.safetensors.index.json"), "w").write(text)
    return str(d)


@pytest.mark.parametrize("case", ["dotdot", "abs", "notdict", "list", "wm_list", "not_json", "name_int"])
def test_an_index_naming_files_outside_its_folder_or_not_an_index_is_refused(tmp_path, case, capsys):
    os.makedirs(tmp_path / "elsewhere")
    private = str(tmp_path / "elsewhere" / "private.safetensors")
    safetensors.save_file({"secret": torch.arange(4.0)}, private)
    d = tmp_path / "ck"
    wm = {"dotdot": {"secret": "../elsewhere/private.safetensors"}, "abs": {"secret": private},
          "name_int": {"secret": 3}}.get(case)
    raw = {"notdict": json.dumps({"weight_map": ["a"]}), "list": "[1, 2]", "wm_list": '{"weight_map": [[1, 2]]}',
           "not_json": "{nope"}.get(case)
    path = _indexed(d, wm, raw)
    with pytest.raises(liferaft.CorruptCheckpointError, match="model.safetensors.index.json"):
        open_source(path)
    with pytest.raises(liferaft.CorruptCheckpointError, match="model.safetensors.index.json"):
        check_source(path)
    with pytest.raises(liferaft.CorruptCheckpointError, match="model.safetensors.index.json"):
        liferaft.load(path, {"secret": torch.zeros(4)})
    for cmd in ("inspect", "read", "verify"):
        assert main([cmd, path]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "index.json" in err[0], err


def test_a_shard_link_out_of_the_folder_is_refused(tmp_path):
    os.makedirs(tmp_path / "elsewhere")
    private = str(tmp_path / "elsewhere" / "private.safetensors")
    safetensors.save_file({"secret": torch.arange(4.0)}, private)
    d = _indexed(tmp_path / "ck", {"secret": "model-1.safetensors"})
    os.symlink(private, os.path.join(d, "model-1.safetensors"))
    with pytest.raises(liferaft.CorruptCheckpointError, match="outside its folder"):
        open_source(d)
    single = tmp_path / "single"
    single.mkdir()
    os.symlink(private, single / "model.safetensors")
    with pytest.raises(liferaft.CorruptCheckpointError, match="outside its folder"):
        check_source(str(single))


def test_an_index_or_a_file_that_is_a_fifo_never_hangs(tmp_path):
    d = _indexed(tmp_path / "shard", {"x": "model-1.safetensors"})
    os.mkfifo(os.path.join(d, "model-1.safetensors"))
    idx = tmp_path / "idx"
    idx.mkdir()
    os.mkfifo(idx / "model.safetensors.index.json")
    single = tmp_path / "single"
    single.mkdir()
    os.mkfifo(single / "model.safetensors")
    file = str(tmp_path / "w.safetensors")
    os.mkfifo(file)
    for path in (d, str(idx), str(single)):
        for cmd in ("inspect", "read", "verify"):
            one_error(cli(cmd, path), "FIFO")
        one_error(cli("convert", path, str(tmp_path / "imported"), "--to", "liferaft"), "FIFO")
    one_error(cli("inspect", file), file)
    code = ("import sys, liferaft; from liferaft.formats.safetensors import safetensors_state\n"
            "try: safetensors_state(sys.argv[1])\n"
            "except liferaft.CorruptCheckpointError as e: print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code, file], capture_output=True, text=True, timeout=30)
    assert "refused:" in r.stdout and "FIFO" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- (8) crafted headers


def _st(path, header, data=b"", raw: bytes | None = None) -> str:
    body = raw if raw is not None else json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(body)) + body + data)
    return str(path)


HEADERS = {
    "spec_str": ({"a": "x"}, b""),
    "neg_shape": ({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}, b"\0" * 16),
    "float_off": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}}, b"\0" * 16),
    "huge_shape": ({"a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}, b""),
    "bool_shape": ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
    "no_dtype": ({"a": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "dtype_int": ({"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "three_offsets": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 8),
    "backwards": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}, b"\0" * 8),
    "wrong_size": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8),
    "past_end": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "overlap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    "metadata": ({"__metadata__": {"format": 1}}, b""),
    "metadata_list": ({"__metadata__": ["x"]}, b""),
    "header_list": ([1, 2], b""),
    "65_dims": ({"a": {"dtype": "F32", "shape": [0] + [1] * 64, "data_offsets": [0, 0]}}, b""),
}


@pytest.mark.parametrize("case", [*HEADERS, "not_utf8", "dup_keys", "too_long", "short"])
def test_a_crafted_header_is_refused_by_every_reader(tmp_path, case, capsys):
    path = str(tmp_path / f"{case}.safetensors")
    if case == "not_utf8":
        _st(path, None, raw=b"\xff\xfe\xfd\xfc")
    elif case == "dup_keys":
        _st(path, None, b"\0" * 4, raw=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                       b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
    elif case == "too_long":
        open(path, "wb").write(struct.pack("<Q", 2**63) + b"{}")
    elif case == "short":
        open(path, "wb").write(b"\x02\0\0")
    else:
        _st(path, *HEADERS[case])
    with pytest.raises(liferaft.CorruptCheckpointError, match=f"{case}.safetensors"):
        open_source(path)
    with pytest.raises(liferaft.CorruptCheckpointError, match=f"{case}.safetensors"):
        liferaft.load(path, {"a": torch.zeros(4)})
    r = check_source(path)
    assert len(r.faults) == 1 and f"{case}.safetensors" in r.faults[0]
    for cmd in ("inspect", "read", "verify"):
        assert main([cmd, path]) == 1, cmd
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
    folder = tmp_path / "folder"
    folder.mkdir()
    os.replace(path, folder / "model.safetensors")
    with pytest.raises(liferaft.CorruptCheckpointError, match="model.safetensors"):
        liferaft.convert(str(folder), str(tmp_path / "imported"), "liferaft")


def test_an_unknown_dtype_is_named_and_good_headers_still_read(tmp_path):
    path = _st(tmp_path / "c64.safetensors", {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
               b"\0" * 8)
    with pytest.raises(liferaft.InvalidStateError, match="C64"):
        open_source(path)
    ok = _st(tmp_path / "ok.safetensors", {"__metadata__": {"format": "pt"},
                                          "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
                                          "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          "b": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}},
             struct.pack("<ffq", 1.0, 2.0, 7))
    src = open_source(ok)
    assert src.tensors["e"].shape == (0, 3)
    empty = str(tmp_path / "empty.safetensors")       # as safetensors.save_file writes one empty tensor
    _st(empty, {"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})
    assert open_source(empty).tensors["w"].shape == (0,) and not check_source(empty).faults
    assert main(["read", empty]) == 0
    assert torch.equal(src.read_box("a", ((0,), (2,))), torch.tensor([1.0, 2.0]))
    assert int(src.read_box("b", ((), ()))) == 7
    assert not check_source(ok).faults


# --------------------------------------------------------------------------- (9) recorded files written back


@pytest.mark.parametrize("files", [
    {"": "x"}, {"a": "x", "a/b": "y"}, {"a\x00b": "x"}, {"model.safetensors": "not weights"},
    {"model-00001-of-00002.safetensors": "x"}, {"model.safetensors.index.json": "{}"}, {"../up.txt": "x"},
    {"/abs.txt": "x"}, {"a//b": "x"}, {"a\\b": "x"}, {"./a": "x"}, {"sub/pytorch_model.bin": "x"},
    {"tok.json": 3}, ["config.json"], {"model.safetensors/x.json": "x"},
    {"model-00001-of-00002.safetensors/a/b.txt": "x"}, {"model.safetensors.index.json/x": "x"},
])
def test_recorded_files_that_are_no_plain_config_names_are_refused_before_anything_is_written(tmp_path, files):
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"model": M()})
    recorded = {**files, "config.json": "{}"} if isinstance(files, dict) else files
    _resign(ck, lambda d: d.setdefault("extra", {}).update({"hf": {"files": recorded}}))
    out = tmp_path / "out"
    with pytest.raises(liferaft.CorruptCheckpointError, match="recorded in the manifest|metadata"):
        liferaft.convert(ck, str(out), "hf")
    assert not out.exists()                       # nothing written: the weights come after the names are checked
    assert os.listdir(tmp_path) == ["ck"]


def test_an_export_writes_through_no_link_in_its_output_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("V")
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"model": M()})
    _resign(ck, lambda d: d.setdefault("extra", {}).update(
        {"hf": {"files": {"tok/evil.txt": "written outside", "config.json": "{}"}}}))
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "tok")
    with pytest.raises(liferaft.OptionsError, match="tok/evil.txt"):
        liferaft.convert(ck, str(out), "hf")
    assert sorted(os.listdir(outside)) == ["victim"]
    # links (and a FIFO) at the names an export writes are replaced, never written through
    _resign(ck, lambda d: d["extra"].update({"hf": {"files": {"config.json": "{}", "sub/t.txt": "t"}}}))
    out2 = tmp_path / "out2"
    out2.mkdir()
    for name in ("model.safetensors.tmp", "config.json"):
        os.symlink(outside / "victim", out2 / name)
    os.mkfifo(out2 / "sub.fifo")
    (out2 / "sub").mkdir()
    os.mkfifo(out2 / "sub" / "t.txt")
    r = cli("convert", ck, str(out2), "--to", "hf")
    assert r.returncode == 0, r.stderr
    assert (outside / "victim").read_text() == "V" and sorted(os.listdir(outside)) == ["victim"]
    assert not os.path.islink(out2 / "config.json") and (out2 / "sub" / "t.txt").read_text() == "t"
    assert set(open_source(str(out2)).tensors) == {"lin.weight", "lin.bias"}
    # a config file that is a folder in the output: a clear error
    out3 = tmp_path / "out3"
    (out3 / "config.json").mkdir(parents=True)
    with pytest.raises(liferaft.OptionsError, match="config.json"):
        liferaft.convert(ck, str(out3), "hf")


# --------------------------------------------------------------------------- what must still work


def test_a_hub_cache_snapshot_with_links_into_blobs_imports_and_exports(tmp_path):
    repo = tmp_path / "hub" / "models--org--m"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    (snap / "1_Pooling").mkdir(parents=True)
    safetensors.save_file({"lin.weight": torch.ones(2, 2), "lin.bias": torch.zeros(2)}, str(blobs / "w"))
    (blobs / "c").write_text('{"model_type": "x", "torch_dtype": "float32"}')
    (blobs / "p").write_text('{"pooling": 1}')
    os.symlink("../../blobs/w", snap / "model.safetensors")
    os.symlink("../../blobs/c", snap / "config.json")
    os.symlink("../../../blobs/p", snap / "1_Pooling" / "config.json")
    src = open_source(str(snap))
    assert set(src.tensors) == {"lin.weight", "lin.bias"}
    assert not check_source(str(snap)).faults
    ck = str(tmp_path / "ck")
    liferaft.convert(str(snap), ck, "liferaft")
    out = tmp_path / "link_to_out"
    real = tmp_path / "real_out"
    real.mkdir()
    os.symlink(real, out)                           # an output folder that is a link is followed, once
    r = liferaft.convert(ck, str(out), "hf", dtype="bfloat16")
    assert "1_Pooling/config.json" in r.files and (real / "1_Pooling" / "config.json").read_text() == '{"pooling": 1}'
    assert json.loads((real / "config.json").read_text())["torch_dtype"] == "bfloat16"
    r = liferaft.convert(ck, str(tmp_path / "out2"), "hf", config=str(snap))
    assert sorted(r.files) == ["1_Pooling/config.json", "config.json", "model.safetensors"]
