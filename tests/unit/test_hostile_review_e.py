"""Hostile review E (the tools as a careless or hostile user drives them), each finding as a class of input: an
import whose renaming gives two keys one name (one was dropped), an export into a folder of weights liferaft did
not write (a downloaded model, overwritten) or interrupted while replacing an earlier export (a mixture that loaded
as complete), ``gc --incomplete`` and step folders holding files liferaft never writes (deleted)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from clirun import liferaft_cli
from safetensors.torch import load_file, save_file

import liferaft
from liferaft.errors import CheckpointExistsError, CorruptCheckpointError, OptionsError


def _two_keys(tmp_path, fmt: str) -> str:
    state = {"a.w": torch.ones(4), "b.w": torch.zeros(4)}
    if fmt == "safetensors":
        save_file(state, str(tmp_path / "m.safetensors"))
        return str(tmp_path / "m.safetensors")
    if fmt == "torch":
        torch.save(state, str(tmp_path / "m.pt"))
        return str(tmp_path / "m.pt")
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    return str(tmp_path / "dcp")


_FORMATS = ["safetensors", "torch", "dcp", "liferaft"]


@pytest.mark.parametrize(("fmt", "to"), [(a, b) for a in _FORMATS for b in _FORMATS if a != b])
def test_a_renaming_that_gives_two_keys_one_name_is_refused_in_every_direction(tmp_path, fmt, to):
    src = _two_keys(tmp_path, fmt) if fmt != "liferaft" else str(tmp_path / "lf")
    if fmt == "liferaft":
        liferaft.save(src, {"a.w": torch.ones(4), "b.w": torch.zeros(4)})
    dst = str(tmp_path / "out")
    with pytest.raises(OptionsError, match=r"two keys to one name: 'a\.w' and 'b\.w' both become 'x\.w'"):
        liferaft.convert(src, dst, to, rename=[(r"^[ab]\.", "x.")])
    r = liferaft_cli("convert", src, str(tmp_path / "out2"), "--to", to, "--rename", r"^[ab]\.", "x.", timeout=120)
    assert r.returncode == 1 and "both become" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a renaming that keeps the names apart still works
    liferaft.convert(src, str(tmp_path / "ok"), to, rename=[(r"^([ab])\.", r"x.\1.")])


def test_an_export_never_overwrites_weights_liferaft_did_not_write(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, {"model": torch.nn.Linear(4, 4)})
    hub = tmp_path / "bert-base"                    # a downloaded model: weights and config
    hub.mkdir()
    save_file({"embeddings.weight": torch.ones(8, 2)}, str(hub / "model.safetensors"))
    (hub / "config.json").write_text('{"model_type": "bert"}')
    before = (hub / "model.safetensors").read_bytes()
    for to in ("hf", "safetensors"):
        with pytest.raises(CheckpointExistsError, match="weights liferaft did not export"):
            liferaft.convert(src, str(hub), to)
        r = liferaft_cli("convert", src, str(hub), "--to", to, timeout=120)
        assert r.returncode == 1 and "did not export" in r.stderr, r.stderr
    assert (hub / "model.safetensors").read_bytes() == before
    other = tmp_path / "other"                      # any framework's weights: a .bin, a sharded index
    other.mkdir()
    (other / "pytorch_model.bin.index.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="did not export"):
        liferaft.convert(src, str(other), "hf")
    # an earlier liferaft export (one file, then shards, then one file again) is replaced, as documented
    out = str(tmp_path / "out")
    for shard in (5 << 30, 64, 5 << 30):
        liferaft.convert(src, out, "safetensors", max_shard_bytes=shard)
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_an_interrupted_reexport_leaves_no_mixture_that_loads(tmp_path):
    step1, step2, out = (str(tmp_path / n) for n in ("step1", "step2", "out"))
    liferaft.save(step1, {"a": torch.full((1024,), 1.0), "b": torch.full((1024,), 1.0)})
    liferaft.save(step2, {"a": torch.full((1024,), 2.0), "b": torch.full((1024,), 3.0)})
    liferaft.convert(step1, out, "safetensors", max_shard_bytes=4096)
    assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) == 2
    # the second shard's source bytes damaged: the export fails after writing the first shard
    three = torch.full((1024,), 3.0).numpy().tobytes()
    hit = 0
    for folder, _, files in os.walk(step2):
        for name in files:
            p = os.path.join(folder, name)
            data = bytearray(open(p, "rb").read())
            at = data.find(three[:64])
            if at >= 0:
                data[at + 10] ^= 0xFF
                open(p, "wb").write(bytes(data))
                hit += 1
    assert hit == 1
    with pytest.raises(CorruptCheckpointError):
        liferaft.convert(step2, out, "safetensors", max_shard_bytes=4096)
    names = sorted(os.listdir(out))
    # what is left is never a complete-looking set: no index (nor a single model.safetensors) naming old shards
    assert "model.safetensors.index.json" not in names and "model.safetensors" not in names, names
    for n in names:                                 # and nothing of step 1 is left to be mixed in
        if n.endswith(".safetensors"):
            assert all(float(t[0]) == 2.0 for t in load_file(os.path.join(out, n)).values()), n


def test_gc_incomplete_leaves_step_folders_holding_files_liferaft_never_writes(tmp_path):
    root = tmp_path / "root"
    for s in (1, 2):
        liferaft.save(str(root / f"step-{s:010d}"), {"w": torch.ones(3) * s})
    (root / "step-0000000005").mkdir()
    torch.save({"w": torch.ones(3)}, str(root / "step-0000000005" / "model.pt"))
    (root / "step-0000000006").mkdir()
    (root / "step-0000000006" / "results.json").write_text(json.dumps({"acc": 0.9}))
    liferaft.save(str(root / "step-0000000007"), {"w": torch.ones(3)})
    os.unlink(root / "step-0000000007" / "COMMIT")   # a save that never committed: a leftover
    r = liferaft_cli("ls", str(root), timeout=120)
    assert r.returncode == 0 and "gc leaves it" in r.stdout, r.stdout
    report = liferaft.gc(str(root), keep_last=5, incomplete=True)
    assert report.deleted == (7,)
    assert sorted(os.listdir(root)) == ["step-0000000001", "step-0000000002", "step-0000000005", "step-0000000006"]
    assert os.path.exists(root / "step-0000000005" / "model.pt")


def test_stats_keep_the_spread_of_values_far_from_zero(tmp_path):
    from liferaft.tools.stats import describe

    w = (1e8 + torch.tensor([-1.0, 1.0], dtype=torch.float64)).repeat(5000)     # std exactly 1
    big = torch.full((64,), 1e300, dtype=torch.float64)                         # a sum that overflows
    liferaft.save(str(tmp_path / "c"), {"w": w, "big": big})
    st = {i.key: i.stats for i in describe(str(tmp_path / "c"), stats=True, slab_bytes=4096)}   # many slabs
    assert st["w"]["std"] == pytest.approx(1.0, rel=1e-9) and st["w"]["mean"] == pytest.approx(1e8, rel=1e-15)
    assert st["big"]["mean"] == pytest.approx(1e300) and st["big"]["std"] == pytest.approx(0.0, abs=1e290)
    out = liferaft_cli("inspect", str(tmp_path / "c"), "w", "--stats", timeout=120)
    assert out.returncode == 0 and "min 99999999 " in out.stdout and "max 100000001 " in out.stdout, out.stdout


def test_gc_says_why_it_waits_behind_another_jobs_lease(tmp_path):
    from liferaft.manager.lease import Lease
    from liferaft.storage import resolve

    root = tmp_path / "root"
    liferaft.save(str(root / "step-0000000001"), {"w": torch.ones(3)})
    held = Lease(resolve(str(root)), "job-\x1b]0;x\x07a", ttl=2.0)     # (a job id that is an escape sequence)
    held.acquire()
    try:
        r = liferaft_cli("gc", str(root), "--keep-last", "1", timeout=120)
    finally:
        held.release()
    assert r.returncode == 1 and "in use" in r.stderr, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("liferaft gc: ") and "waiting up to 2 s" in first and "\x1b" not in r.stderr, r.stderr


def test_diff_of_two_torch_files_compares_container_types_exactly(tmp_path):
    torch.save({"w": torch.ones(2), "cfg": {"d": {1: "x"}}, "milestones": [10, 20], "names": {0: "a", 1: "b"}},
               str(tmp_path / "a.pt"))
    torch.save({"w": torch.ones(2), "cfg": {"d": {"1": "x"}}, "milestones": (10, 20), "names": ["a", "b"]},
               str(tmp_path / "b.pt"))
    r = liferaft.diff(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert {k.key: k.status for k in r.keys} == {"w": "equal", "cfg": "changed", "milestones": "changed",
                                                  "names": "changed"}


def test_an_export_refuses_a_hub_cache_snapshot_and_ignores_files_that_are_no_weights(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, {"model": torch.nn.Linear(4, 4)})
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(blobs / "sha"))
    os.symlink(blobs / "sha", snap / "model.safetensors")          # how the hub cache lays a snapshot out
    with pytest.raises(CheckpointExistsError, match="did not export"):
        liferaft.convert(src, str(snap), "hf")
    assert os.path.islink(snap / "model.safetensors") and load_file(str(blobs / "sha"))["w"].tolist() == [1.0, 1.0]
    run = tmp_path / "run"                                          # a Trainer's folder: no weights in it
    run.mkdir()
    (run / "training_args.bin").write_bytes(b"\x80\x04N.")
    liferaft.convert(src, str(run), "hf")
    assert (run / "training_args.bin").read_bytes() == b"\x80\x04N." and (run / "model.safetensors").exists()


def test_diff_of_two_torch_files_takes_an_ordered_dict_for_the_dict_it_equals(tmp_path):
    from collections import OrderedDict

    torch.save({"cfg": {"a": 1, "b": [1]}}, str(tmp_path / "a.pt"))
    torch.save({"cfg": OrderedDict(a=1, b=[1])}, str(tmp_path / "b.pt"))
    assert all(k.status == "equal" for k in liferaft.diff(str(tmp_path / "a.pt"), str(tmp_path / "b.pt")).keys)
