"""``liferaft diff`` compares plain values by value, whatever container shape each format rebuilt them in (DCP's
flattened leaves, lists vs tuples, int vs string keys), and ``--rename`` / ``--module`` check an export against
its source."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.tools.diff import value_difference


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DCP checkpoint written by torch's own ``dcp.save`` of a model and its AdamW state (param_groups with
    tuples, None, bools, a list of parameter names), and the same state saved again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    root = tmp_path_factory.mktemp("diff")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": 2,
             "sched": {"milestones": [10, 20], "gamma": 0.5}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
        dcp.save(state, checkpoint_id=str(root / "dcp2"), no_dist=True)
    return {"dcp": str(root / "dcp"), "dcp2": str(root / "dcp2"), "root": root, "model": model}


def test_a_torch_written_dcp_and_its_liferaft_conversion_are_identical(trained):
    ck = str(trained["root"] / "converted")
    liferaft.convert(trained["dcp"], ck, "liferaft")
    for a, b in ((trained["dcp"], ck), (ck, trained["dcp"])):
        r = liferaft.diff(a, b)
        assert r.identical, [(k.key, k.status, k.detail) for k in r.changed()]
        assert any(k.key == "optim.param_groups" and k.status == "equal" for k in r.keys)


def test_two_dcp_folders_of_the_same_state_are_identical_whoever_wrote_them(trained):
    assert liferaft.diff(trained["dcp"], trained["dcp2"]).identical
    ck = str(trained["root"] / "via-liferaft")
    liferaft.convert(trained["dcp"], ck, "liferaft")
    again = str(trained["root"] / "dcp-by-liferaft")            # keeps param_groups whole, where torch split it
    liferaft.convert(ck, again, "dcp")
    r = liferaft.diff(trained["dcp"], again)
    assert r.identical, [(k.key, k.status, k.detail) for k in r.changed()]


def test_a_real_difference_in_a_nested_value_is_found_and_located(trained, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    liferaft.convert(trained["dcp"], ck, "liferaft")
    tree = liferaft.read(ck)
    tree["optim"]["param_groups"][0]["betas"] = (0.8, 0.999)
    liferaft.save(str(tmp_path / "changed"), tree)
    r = liferaft.diff(trained["dcp"], str(tmp_path / "changed"))
    assert [(k.key, k.status) for k in r.changed()] == [("optim.param_groups", "changed")]
    assert r.changed()[0].detail == "[0]['betas'][1]: 0.99 vs 0.999"
    assert main(["diff", trained["dcp"], str(tmp_path / "changed")]) == 1
    assert "changed  optim.param_groups  [0]['betas'][1]: 0.99 vs 0.999" in capsys.readouterr().out


@pytest.mark.parametrize("a, b", [
    ([1, (2, 3)], ((1, [2, 3]))),                                   # list / tuple
    ({0: "x", 1: {"k": 2}}, {"0": "x", "1": {"k": 2}}),             # int keys / their strings
    ([{"lr": 0.1}, {"lr": 0.2}], {"0": {"lr": 0.1}, "1": {"lr": 0.2}}),   # a list DCP flattened into index keys
    (np.float32(0.5), 0.5), (np.int64(3), 3),                       # numpy scalars / Python numbers
    (np.arange(3, dtype=np.int16), torch.arange(3, dtype=torch.int16)),
    (float("nan"), float("nan")), (b"ab", bytearray(b"ab")), (torch.Size([2, 3]), [2, 3]),
])
def test_values_equal_by_value(a, b):
    assert value_difference(a, b) is None and value_difference(b, a) is None


@pytest.mark.parametrize("a, b, where", [
    ([1, 2], [1, 2, 3], "the value: 2 item(s) vs 3"),
    ({"a": 1}, {"b": 1}, "the value: keys only in A ['a'], only in B ['b']"),
    ({"0": 1, "2": 1}, [1, 1], "the value: {'0': 1, '2': 1} vs [1, 1]"),     # not 0..n-1: not a list
    ([{"lr": 0.1}], [{"lr": 0.2}], "[0]['lr']: 0.1 vs 0.2"),
    (np.arange(3, dtype=np.int16), torch.arange(3), "the value: tensor [3] int16 vs [3] int64"),
    (1.0, math.inf, "the value: 1.0 vs inf"), ("x", None, "the value: 'x' vs None"),
])
def test_values_that_differ_say_where(a, b, where):
    assert value_difference(a, b) == where


def test_an_hf_export_is_checked_against_its_source_with_module_or_rename(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    liferaft.save(ck, {"model": model, "optim": opt, "step": 1})
    liferaft.convert(ck, hf, "hf")
    assert main(["diff", ck, hf, "--module", "model"]) == 0
    assert "identical: 4 of 4 key(s) equal" in capsys.readouterr().out
    assert main(["diff", ck, hf, "--rename", "^", "model.", "-k", "model.*"]) == 0
    assert "identical: 4 of 4 key(s) equal" in capsys.readouterr().out
    assert main(["diff", ck, hf]) == 1                           # without: nothing matches by name
    capsys.readouterr()
    r = liferaft.diff(ck, hf, rename=[("^", "model.")])
    assert {k.status for k in r.changed()} == {"removed"} and all(not k.key.startswith("model.") for k in r.changed())
    import safetensors.torch

    weights = safetensors.torch.load_file(f"{hf}/model.safetensors")
    weights["1.bias"] = weights["1.bias"] + 0.25
    safetensors.torch.save_file(weights, f"{hf}/model.safetensors")
    r = liferaft.diff(ck, hf, module="model")
    assert [(k.key, k.status) for k in r.changed()] == [("model.1.bias", "changed")]
    assert abs(r.changed()[0].max_abs - 0.25) < 1e-6
    with pytest.raises(liferaft.OptionsError, match="two keys to one name"):
        liferaft.diff(ck, hf, rename=[(".*", "x")])
