"""The streamed DCP and torch.save conversions: DCP's own loader, ``dcp_to_torch_save``, ``torch.load`` and
``zipfile`` accept what liferaft writes; round trips are bit-exact; keys are selected, renamed and cast in every
direction; a DCP checkpoint never runs code (refused metadata and values), damaged ones are named; ``Sharded``
with several boxes per rank."""

from __future__ import annotations

import os
import pickle
import zipfile

import numpy as np
import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.formats.dcp import DcpCheckpoint
from liferaft.tools.convert import to_dcp, to_torch


def nested():
    g = torch.Generator().manual_seed(1)
    return {"model": {"emb.weight": torch.randn(1000, 40, generator=g),
                      "layers": [torch.randn(40, 40, generator=g), torch.zeros(0, 5)],
                      "half": torch.randn(33, 7, generator=g).to(torch.bfloat16)},
            "ids": torch.arange(17), "scalar": torch.tensor(2.5), "flag": torch.tensor(True), "step": 9,
            "sched": {"last_epoch": 3, "lrs": [0.1, 0.01]}}


def _save(path):
    liferaft.save(path, nested(), options=liferaft.SaveOptions(chunk_bytes=64 << 10))  # several chunks
    return path


def _zeros_like(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros_like(v) for v in tree]
    return None


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_dcp_export_is_read_by_dcp_and_its_converter_and_comes_back_bit_exact(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, out = _save(str(tmp_path / "ck")), str(tmp_path / "dcp")
    rep = to_dcp(src, out, slab_bytes=4 << 10)
    assert rep.tensors == 7
    assert len(DcpCheckpoint(out).tensors["model.emb.weight"].chunks) > 5          # row slabs as DCP chunks
    target = _zeros_like(nested())
    target["step"], target["sched"] = 0, {"last_epoch": 0, "lrs": []}
    dcp.load(target, checkpoint_id=out, no_dist=True)                              # DCP's own loader
    assert _equal(target, nested())
    dcp_to_torch_save(out, str(tmp_path / "dcp.pt"))                                # DCP's own converter
    assert _equal(torch.load(tmp_path / "dcp.pt", weights_only=True), nested())
    back = str(tmp_path / "back")
    assert liferaft.convert(out, back, "liferaft").tensors == 7
    assert liferaft.diff(src, back).identical
    with pytest.raises(liferaft.StateMismatchError, match="already holds a DCP checkpoint"):
        liferaft.convert(src, out, "dcp")


def test_torch_export_is_streamed_into_a_valid_archive(tmp_path):
    src, out = _save(str(tmp_path / "ck")), str(tmp_path / "m.pt")
    to_torch(src, out, slab_bytes=4 << 10)
    assert zipfile.ZipFile(out).testzip() is None                       # every record's CRC matches its data
    assert _equal(torch.load(out, weights_only=True), nested())
    assert _equal(torch.load(out, weights_only=True, mmap=True), nested())
    back = str(tmp_path / "back")
    liferaft.convert(out, back, "liferaft")
    assert liferaft.diff(src, back).identical


def test_keys_are_selected_renamed_and_cast_in_every_direction(tmp_path):
    src = _save(str(tmp_path / "ck"))
    pick, ren = ["model.*"], [(r"^model\.", "net.")]
    liferaft.convert(src, str(tmp_path / "t.pt"), "torch", keys=pick, rename=ren, dtype="bfloat16")
    flat = torch.load(tmp_path / "t.pt", weights_only=True)
    assert set(flat) == {"net.emb.weight", "net.layers.0", "net.layers.1", "net.half"}
    assert flat["net.emb.weight"].dtype == torch.bfloat16
    assert torch.equal(flat["net.emb.weight"], nested()["model"]["emb.weight"].to(torch.bfloat16))

    liferaft.convert(src, str(tmp_path / "dcp"), "dcp", keys=["model.layers.*", "step"], rename=[("layers", "L")])
    ck = DcpCheckpoint(str(tmp_path / "dcp"))
    assert set(ck.tensors) == {"model.L.0", "model.L.1"} and set(ck.values) == {"step"}

    liferaft.convert(str(tmp_path / "dcp"), str(tmp_path / "a"), "liferaft", keys=["model.*"],
                     rename=[(r"\.L\.", ".blocks.")])
    assert set(liferaft.read(str(tmp_path / "a"))) == {"model.blocks.0", "model.blocks.1"}

    torch.save(nested(), tmp_path / "n.pt")
    liferaft.convert(str(tmp_path / "n.pt"), str(tmp_path / "b"), "liferaft", keys=["model.emb.*", "ids"],
                     rename=[("emb", "embed")])
    got = liferaft.read(str(tmp_path / "b"))
    assert set(got) == {"model.embed.weight", "ids"} and torch.equal(got["ids"], torch.arange(17))

    with pytest.raises(liferaft.OptionsError, match="no key"):
        liferaft.convert(src, str(tmp_path / "c.pt"), "torch", keys=["nothing.*"])
    with pytest.raises(liferaft.OptionsError, match="two keys to one"):
        liferaft.convert(src, str(tmp_path / "d.pt"), "torch", rename=[(".*", "same")])
    with pytest.raises(liferaft.OptionsError, match="both sides are liferaft"):
        liferaft.convert(src, str(tmp_path / "e"), "liferaft")
    with pytest.raises(liferaft.StateMismatchError, match="nothing recognizable"):
        liferaft.convert(str(tmp_path), str(tmp_path / "f"), "liferaft")


class Custom:
    pass


def test_dcp_metadata_and_values_never_run_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3), "obj": Custom()}, checkpoint_id=out, no_dist=True)
    with pytest.raises(liferaft.PickleNotAllowedError, match="'obj'"):
        liferaft.convert(out, str(tmp_path / "x"), "liferaft")
    target = {"w": torch.zeros(3)}
    liferaft.load(out, target, strict=False)                          # the tensor alone loads
    assert torch.equal(target["w"], torch.ones(3))

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(liferaft.PickleNotAllowedError, match="never runs code|does not unpickle"):
        DcpCheckpoint(out)
    assert not (tmp_path / "pwned").exists()


def test_damaged_dcp_checkpoints_are_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=out, no_dist=True)
    data = next(f for f in os.listdir(out) if f.endswith(".distcp"))
    with open(os.path.join(out, data), "r+b") as f:
        f.truncate(100)
    with pytest.raises(liferaft.CorruptCheckpointError, match=data):
        liferaft.load(out, {"w": torch.zeros(1000)})
    os.remove(os.path.join(out, data))
    with pytest.raises(liferaft.CorruptCheckpointError, match="missing"):
        liferaft.convert(out, str(tmp_path / "x"), "liferaft")
    with pytest.raises(liferaft.StateMismatchError, match="shape|holds"):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "d2"), no_dist=True)
        liferaft.load(str(tmp_path / "d2"), {"w": torch.zeros(5)})


def test_dcp_chunks_keep_their_strides(tmp_path):
    import torch.distributed.checkpoint as dcp

    x = torch.randn(30, 20)
    out = str(tmp_path / "dcp")
    dcp.save({"t": x.t(), "v": x[:, 3]}, checkpoint_id=out, no_dist=True)      # transposed; a strided column
    liferaft.convert(out, str(tmp_path / "ck"), "liferaft")
    got = liferaft.read(str(tmp_path / "ck"))
    assert torch.equal(got["t"], x.t()) and torch.equal(got["v"], x[:, 3])
    part = torch.zeros(5, 30)
    liferaft.load(out, {"t": liferaft.Sharded(part, (20, 30), (10, 0)), "v": torch.zeros(30)})
    assert torch.equal(part, x.t()[10:15])


def test_dcp_extension_compressed_chunks_are_read(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    w = torch.randn(64, 8)
    out = str(tmp_path / "dcp")
    dcp.save({"w": w, "n": 4}, storage_writer=dcp.FileSystemWriter(out, _extensions=[ZStandard()]), no_dist=True)
    liferaft.convert(out, str(tmp_path / "ck"), "liferaft")
    assert torch.equal(liferaft.read(str(tmp_path / "ck"))["w"], w)


def test_sharded_with_several_boxes_per_rank(tmp_path):
    full = torch.randn(10, 6)
    s = liferaft.Sharded(full[:4].clone(), (10, 6), (0, 0), more=[((4, 0), full[4:7].clone()),
                                                                   ((7, 0), full[7:].clone())])
    liferaft.save(str(tmp_path / "ck"), {"w": s})
    assert torch.equal(liferaft.read(str(tmp_path / "ck"))["w"], full)
    t = liferaft.Sharded(torch.zeros(3, 6), (10, 6), (0, 0), more=[((5, 0), torch.zeros(5, 6))])
    liferaft.load(str(tmp_path / "ck"), {"w": t})
    assert torch.equal(t.local, full[:3]) and torch.equal(t.more[0][1], full[5:])
    with pytest.raises(liferaft.InvalidStateError, match="overlap"):
        liferaft.Sharded(torch.zeros(3, 6), (10, 6), (0, 0), more=[((2, 0), torch.zeros(5, 6))])
    with pytest.raises(liferaft.InvalidStateError, match="one dtype"):
        liferaft.Sharded(torch.zeros(3, 6), (10, 6), (0, 0), more=[((5, 0), torch.zeros(5, 6, dtype=torch.half))])


def test_numpy_arrays_and_large_bytes_are_exported_loadable_without_pickle(tmp_path):
    arr, blob = np.arange(100_000, dtype=np.float32), bytes(range(256)) * 400     # both over 64 KiB
    liferaft.save(str(tmp_path / "ck"), {"arr": arr, "blob": blob, "w": torch.ones(2)})
    liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "m.pt"), "torch")
    got = torch.load(tmp_path / "m.pt", weights_only=True)           # numpy arrays come out as tensors
    assert torch.equal(got["arr"], torch.from_numpy(arr)) and got["blob"] == blob
    liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "dcp"), "dcp")
    ck = DcpCheckpoint(str(tmp_path / "dcp"))
    assert torch.equal(ck.chunk("arr", ck.tensors["arr"].chunks[0]), torch.from_numpy(arr))
    assert ck.value("blob") == blob


def test_convert_command_dcp_and_torch_directions(tmp_path):
    import json

    src = _save(str(tmp_path / "ck"))

    def run(*a, code=0):
        out = liferaft_cli(*a, timeout=120)
        assert out.returncode == code, out.stderr
        return out

    doc = json.loads(run("convert", src, str(tmp_path / "dcp"), "--to", "dcp", "--json").stdout)
    assert (doc["from"], doc["to"], doc["tensors"]) == ("liferaft", "dcp", 7)
    assert "dcp → liferaft" in run("convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "liferaft").stdout
    assert "identical" in run("diff", src, str(tmp_path / "back")).stdout
    tree = run("inspect", str(tmp_path / "dcp")).stdout.splitlines()     # a DCP folder, inspected as it is
    assert tree[0].startswith("dcp checkpoint") and tree[1].startswith("7 tensors, 2 values")
    assert any(line.split()[:3] == ["emb.weight", "float32", "[1000,"] for line in tree)
    run("convert", src, str(tmp_path / "t.pt"), "--to", "torch", "-k", "model.*", "--rename", r"^model\.", "",
        "--dtype", "bfloat16")
    got = torch.load(tmp_path / "t.pt", weights_only=True)
    assert set(got) == {"emb.weight", "layers.0", "layers.1", "half"} and got["emb.weight"].dtype == torch.bfloat16
    bad = run("convert", src, str(tmp_path / "x"), "--to", "dcp", "-k", "nope.*", code=1)
    assert len(bad.stderr.strip().splitlines()) == 1 and "no key" in bad.stderr


def test_load_from_dcp_replaces_large_numpy_and_bytes_values(tmp_path):
    arr, blob = np.arange(100_000, dtype=np.float32), bytes(range(256)) * 400
    liferaft.save(str(tmp_path / "ck"), {"arr": arr, "blob": blob, "w": torch.ones(2)})
    liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "dcp"), "dcp")
    state = {"arr": np.zeros(200_000, dtype=np.float32)[::2], "blob": bytes(102_400), "w": torch.zeros(2)}
    liferaft.load(str(tmp_path / "dcp"), state)                  # a strided target array is replaced, not lost
    assert np.array_equal(state["arr"], arr) and state["blob"] == blob and torch.equal(state["w"], torch.ones(2))


def test_optimizer_state_keeps_its_dict_through_dcp(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    liferaft.save(str(tmp_path / "ck"), {"optim": opt.state_dict()})
    liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "dcp"), "dcp")
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "o.pt"))
    sd = torch.load(tmp_path / "o.pt", weights_only=True)["optim"]
    assert isinstance(sd["state"], dict)                          # DCP's own converter rebuilds a dict, not a list
    liferaft.convert(str(tmp_path / "dcp"), str(tmp_path / "back"), "liferaft")
    liferaft.convert(str(tmp_path / "back"), str(tmp_path / "b.pt"), "torch")
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)["optim"]
    fresh.load_state_dict({"state": {int(k): v for k, v in loaded["state"].items()},
                           "param_groups": loaded["param_groups"]})
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_dcp_chunks_must_cover_their_tensor_and_stay_in_the_folder(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(8, 4)}, checkpoint_id=out, no_dist=True)
    meta_path = os.path.join(out, ".metadata")
    original = open(meta_path, "rb").read()
    meta = pickle.loads(original)
    md = meta.state_dict_metadata["w"]
    md.chunks[0] = ChunkStorageMetadata(offsets=md.chunks[0].offsets, sizes=torch.Size([4, 4]))
    md.size = torch.Size([8, 4])
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(liferaft.CorruptCheckpointError):
        liferaft.convert(out, str(tmp_path / "x"), "liferaft")
    meta = pickle.loads(original)
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(liferaft.UnsafePathError, match="outside"):
        liferaft.load(out, {"w": torch.zeros(8, 4)})


def test_a_failed_export_leaves_no_file_and_no_open_descriptor(tmp_path):
    src = _save(str(tmp_path / "ck"))

    def boom(n):
        raise RuntimeError("stop here")

    before = len(os.listdir("/proc/self/fd"))
    for to, out in (("torch", tmp_path / "m.pt"), ("dcp", tmp_path / "dcp")):
        with pytest.raises(RuntimeError, match="stop here"):
            liferaft.tools.convert.convert(src, str(out), to, progress=boom)
    assert len(os.listdir("/proc/self/fd")) == before
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "m.pt.tmp").exists()
    assert not os.path.exists(tmp_path / "dcp" / ".metadata") and not os.path.exists(tmp_path / "dcp" / "__0_0.distcp")


def test_diff_compares_across_formats(tmp_path):
    src = _save(str(tmp_path / "ck"))
    for to, out in (("dcp", "dcp"), ("torch", "m.pt"), ("safetensors", "hf")):
        liferaft.convert(src, str(tmp_path / out), to)
    assert liferaft.diff(src, str(tmp_path / "dcp")).identical       # values too: DCP splits "sched" into leaves
    assert liferaft.diff(str(tmp_path / "m.pt"), src).identical
    only_tensors = liferaft.diff(src, str(tmp_path / "hf"))           # safetensors hold tensors only
    assert {k.key for k in only_tensors.changed()} == {"step", "sched"}
    assert all(k.status == "removed" for k in only_tensors.changed())
    changed = nested()
    changed["model"]["emb.weight"][3, 5] += 0.5
    torch.save(changed, tmp_path / "changed.pt")
    r = liferaft.diff(src, str(tmp_path / "changed.pt"), keys=["model.*"])
    assert [(k.key, k.status) for k in r.changed()] == [("model.emb.weight", "changed")]
    assert abs(r.changed()[0].max_abs - 0.5) < 1e-6


def test_between_two_other_formats_through_a_temporary_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    model = {"embed.weight": torch.randn(50, 8, generator=g), "head.weight": torch.randn(8, 8, generator=g)}
    dcp.save({"model": model, "step": 4}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    rep = liferaft.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), "hf", keys=["model.*"],
                           rename=[(r"^model\.", "")], dtype="bfloat16")            # DCP → HF in one call
    assert rep.tensors == 2
    safetensors = pytest.importorskip("safetensors.torch")
    got = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(got["embed.weight"], model["embed.weight"].to(torch.bfloat16))
    assert sorted(os.listdir(tmp_path)) == ["dcp", "hf"]                     # the temporary checkpoint is gone
    liferaft.convert(str(tmp_path / "hf"), str(tmp_path / "m.pt"), "torch")
    assert liferaft.diff(str(tmp_path / "hf"), str(tmp_path / "m.pt")).identical


def test_an_export_checks_each_data_file_once_not_per_slab(tmp_path, monkeypatch):
    """Exports and diff read a tensor in many row slabs through ``Reader.plan``: the checkpoint's data files are
    checked (present, long enough) once per export, up front, not again for every slab; the result is exact."""
    from liferaft.storage.posix import PosixStorage

    src = str(tmp_path / "ck")
    state = {"w": torch.randn(256, 64), "b": torch.randn(64), "step": 3}
    liferaft.save(src, state, options=liferaft.SaveOptions(compression="off"))
    asked: list[str] = []
    size = PosixStorage.size
    monkeypatch.setattr(PosixStorage, "size", lambda self, name: (asked.append(name), size(self, name))[1])
    to_torch(src, str(tmp_path / "m.pt"), slab_bytes=1024)              # 64 slabs of w
    data = [n for n in asked if n.endswith(".bin")]
    assert data and len(data) == len(set(data)), asked
    got = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 3
    asked.clear()
    to_dcp(src, str(tmp_path / "dcp"), slab_bytes=1024)
    data = [n for n in asked if n.endswith(".bin")]
    assert data and len(data) == len(set(data)), asked
    asked.clear()
    assert liferaft.diff(src, str(tmp_path / "dcp"), slab_bytes=1024).identical
    data = [n for n in asked if n.endswith(".bin")]
    assert len(data) == len(set(data)), asked
