"""One load pipeline and one reader protocol for every format (issue #15): the same state saved as liferaft, DCP,
safetensors and torch.save loads through ``liferaft.load`` with the same checks and the same result, and
``read`` / ``inspect`` / ``verify`` / ``diff`` take each of them."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.tools.convert import to_dcp, to_safetensors, to_torch

FORMATS = ("liferaft", "dcp", "safetensors", "torch")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"layer.weight": torch.randn(6, 4, generator=g), "layer.bias": torch.randn(6, generator=g),
            "emb": torch.randn(5, 3, generator=g).to(torch.bfloat16)}


def model_state() -> dict:
    t = tensors()
    return {"model": {"layer": {"weight": t["layer.weight"], "bias": t["layer.bias"]}, "emb": t["emb"]}}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("formats")
    ck = str(root / "liferaft")
    liferaft.save(ck, model_state())
    out = {"liferaft": ck}
    for fmt, fn in (("dcp", to_dcp), ("safetensors", to_safetensors), ("torch", to_torch)):
        path = str(root / (fmt + (".pt" if fmt == "torch" else "")))
        fn(ck, path)
        out[fmt] = path
    return out


def zeros_like_state(fmt: str) -> dict:
    """A fresh state whose keys are the format's: safetensors keep liferaft's flat keys."""
    if fmt == "safetensors":
        return {f"model.{k}": torch.zeros_like(v) for k, v in tensors().items()}
    return {"model": {"layer": {"weight": torch.zeros(6, 4), "bias": torch.zeros(6)},
                      "emb": torch.zeros(5, 3, dtype=torch.bfloat16)}}


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_through_the_one_pipeline(sources, fmt):
    state = zeros_like_state(fmt)
    res = liferaft.load(sources[fmt], state)
    want = {f"model.{k}": v for k, v in tensors().items()}
    assert all(torch.equal(flat(state)[k], v) for k, v in want.items())
    assert res.bytes_read == sum(v.numel() * v.element_size() for v in want.values())
    assert {"plan", "read", "apply", "total"} <= set(res.timings) and res.rank == 0
    assert liferaft.format_of(sources[fmt]) == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gets_the_same_checks_before_anything_changes(sources, fmt):
    bad = zeros_like_state(fmt)
    key = "model.layer.weight"
    if fmt == "safetensors":
        bad[key] = torch.zeros(6, 5)
    else:
        bad["model"]["layer"]["weight"] = torch.zeros(6, 5)
    with pytest.raises(liferaft.StateMismatchError, match="model.layer.weight"):
        liferaft.load(sources[fmt], bad)
    assert all(torch.count_nonzero(v) == 0 for v in flat(bad).values())            # nothing was loaded
    extra = zeros_like_state(fmt)
    (extra if fmt == "safetensors" else extra["model"])["nope"] = torch.zeros(2)
    with pytest.raises(liferaft.StateMismatchError, match="does not match the .*nope"):
        liferaft.load(sources[fmt], extra)
    res = liferaft.load(sources[fmt], extra, strict=False)
    assert res.missing_keys == ("nope" if fmt == "safetensors" else "model.nope",) and not res.unexpected_keys


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_inspect_verify_and_diff_take_every_format(sources, fmt):
    tree = liferaft.read(sources[fmt])
    got = flat(tree) if fmt != "safetensors" else tree
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in tensors().items())
    sub = liferaft.read(sources[fmt], ["model.layer"])             # one meaning of keys=: a prefix
    assert sorted(flat(sub) if fmt != "safetensors" else sub) == ["model.layer.bias", "model.layer.weight"]
    globbed = liferaft.read(sources[fmt], ["*.bias"])              # ... or a glob
    assert list(flat(globbed) if fmt != "safetensors" else globbed) == ["model.layer.bias"]
    info = liferaft.inspect(sources[fmt])
    assert info.format == fmt and {t.key for t in info.tensors} == {f"model.{k}" for k in tensors()}
    assert info.paths["model.layer.weight"][-1] == ("layer.weight" if fmt == "safetensors" else "weight") or \
        info.paths["model.layer.weight"] == ("model", "layer", "weight")
    report = liferaft.verify(sources[fmt])
    assert report.format == fmt and (report.chunks > 0) == (fmt != "safetensors")
    assert liferaft.diff(sources["liferaft"], sources[fmt]).identical


def test_diff_compares_nested_plain_values_dcp_stored_apart(tmp_path):
    """DCP flattens a nested plain value into one key per leaf; diff and load put it together again."""
    import torch.distributed.checkpoint as dcp

    values = {"sched": {"lr": 0.1, "milestones": [3, 7], "gamma": 0.5}, "step": 4}
    ck, d = str(tmp_path / "ck"), str(tmp_path / "dcp")
    liferaft.save(ck, {"w": torch.arange(4.0), **values})
    dcp.save({"w": torch.arange(4.0), **values}, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    assert liferaft.diff(ck, d).identical
    state = {"w": torch.zeros(4), "sched": {}, "step": 0}
    liferaft.load(d, state)
    assert state["sched"]["lr"] == 0.1 and list(state["sched"]["milestones"]) == [3, 7] and state["step"] == 4


def test_a_torch_save_file_loads_with_weights_only(tmp_path):
    """load takes a torch.save file too (weights_only: no code runs); a pickled object in it is refused."""
    path = str(tmp_path / "m.pt")
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "n": 3}, path)
    state = {"w": torch.zeros(2, 3), "n": 0}
    liferaft.load(path, state)
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and state["n"] == 3

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))
    torch.save({"w": Evil()}, str(tmp_path / "evil.pt"))
    with pytest.raises(liferaft.PickleNotAllowedError):
        liferaft.load(str(tmp_path / "evil.pt"), {"w": torch.zeros(1)})
