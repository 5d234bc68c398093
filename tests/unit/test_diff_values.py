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


# Equality of plain values is exact: every pair below differs, and says so both ways round (a silent "identical"
# for different values is the worst thing diff can do).
def _nan(bits: str) -> float:
    import struct

    return struct.unpack("<d", bytes.fromhex(bits))[0]


class _Color(__import__("enum").IntEnum):
    RED = 1


def _big_strings(changed_at=None, dtype=None):
    a = np.array([str(i) for i in range(2000)], dtype=dtype)
    if changed_at is not None:
        a[changed_at] = "X"
    return a


_DIFFERENT = {
    "bool vs int": (True, 1),
    "int vs float": (1, 1.0),
    "bool vs float": (True, 1.0),
    "0.0 vs -0.0": (0.0, -0.0),
    "complex -0.0": (complex(0.0, 0.0), complex(0.0, -0.0)),
    "str vs int": ("1", 1),
    "bytes vs str": (b"1", "1"),
    "IntEnum vs int": (_Color.RED, 1),
    "int64 array above 2**53": (np.array([2**53, 7], dtype=np.int64), np.array([2**53 + 1, 7], dtype=np.int64)),
    "uint64 array": (np.array([2**64 - 1], dtype=np.uint64), np.array([2**64 - 2], dtype=np.uint64)),
    "int64 tensor above 2**53": (torch.tensor([2**62 + 1]), torch.tensor([2**62])),
    "array 0.0 vs -0.0": (np.array([0.0]), np.array([-0.0])),
    "tensor 0.0 vs -0.0": (torch.tensor([0.0]), torch.tensor([-0.0])),
    "tensor NaN payloads": (torch.tensor([_nan("000000000000f87f")], dtype=torch.float64),
                            torch.tensor([_nan("010000000000f87f")], dtype=torch.float64)),
    "str array of 2000, index 1000": (_big_strings(), _big_strings(1000)),
    "bytes array of 2000, index 1999": (_big_strings(dtype="S"), _big_strings(1999, dtype="S")),
    "longdouble array": (np.array([1.0, 2.0] * 600, dtype=np.longdouble),
                         np.array([1.0, 2.0] * 599 + [1.0, 3.0], dtype=np.longdouble)),
    "longdouble -0.0": (np.array([0.0], dtype=np.longdouble), np.array([-0.0], dtype=np.longdouble)),
    "datetime64 array": (np.array(["2024-01-01"] * 1500, dtype="M8[s]"),
                         np.array(["2024-01-01"] * 1499 + ["2024-01-02"], dtype="M8[s]")),
    "structured array": (np.array([(1, 2.0)], dtype=[("a", "i8"), ("b", "f8")]),
                         np.array([(1, -2.0)], dtype=[("a", "i8"), ("b", "f8")])),
    "object array": (np.array([1, "x"], dtype=object), np.array([True, "x"], dtype=object)),
    "numpy float32 vs float64": (np.float32(0.5), np.float64(0.5)),
    "numpy float32(0.1) vs 0.1": (np.float32(0.1), 0.1),
    "numpy int vs bool": (np.int64(1), True),
    "numpy bool vs int": (np.bool_(True), 1),
    "numpy int64 vs float": (np.int64(3), 3.0),
    "longdouble scalars": (np.longdouble(1) + np.longdouble(2) ** -60, np.longdouble(1)),
    "nested bool vs int": ([{"x": (True,)}], [{"x": (1,)}]),
    "dict keys 1 vs True": ({1: "a"}, {True: "a"}),
    "dict keys 1 vs 1.0": ({1: "a"}, {1.0: "a"}),
    "sets 1 vs True": ({1, 2}, {True, 2}),
    "long strings differing at the end": ("x" * 5000 + "a", "x" * 5000 + "b"),
    "list vs str": (["a"], "a"),
    "sets of numpy float32 0.0 vs -0.0": ({np.float32(-0.0)}, {np.float32(0.0)}),
    "dict keys numpy float16 0.0 vs -0.0": ({np.float16(-0.0): 1}, {np.float16(0.0): 1}),
    "sets of numpy complex64 -0j": ({np.complex64(complex(1, -0.0))}, {np.complex64(complex(1, 0.0))}),
}


@pytest.mark.parametrize("a, b", list(_DIFFERENT.values()), ids=list(_DIFFERENT))
def test_values_that_differ_are_never_equal(a, b):
    assert value_difference(a, b) is not None
    assert value_difference(b, a) is not None


def test_a_difference_says_which_element():
    assert value_difference(*_DIFFERENT["str array of 2000, index 1000"]) == \
        "the value: arrays differ at [1000] (1 of 2000 element(s)): '1000' vs 'X'"
    assert value_difference(*_DIFFERENT["int64 array above 2**53"]) == \
        "the value: tensors differ at [0] (1 of 2 element(s)): 9007199254740992 vs 9007199254740993"
    assert value_difference(True, 1) == "the value: True vs 1"
    assert value_difference(0.0, -0.0) == "the value: 0.0 vs -0.0"
    assert "bits" in value_difference(*_DIFFERENT["tensor NaN payloads"])


# What formats change without changing the value: equal.
_EQUAL = {
    "list / tuple / Size": ([1, (2, 3)], (1, torch.Size([2, 3]))),
    "int keys / strings, nested": ({"a": {0: [1, 2], 7: "x"}}, {"a": {"0": (1, 2), "7": "x"}}),
    "index keys / list": ([{"lr": 0.1}], {0: {"lr": 0.1}}),
    "numpy int64 above 2**53": (np.int64(2**53 + 1), 2**53 + 1),
    "numpy uint64 max": (np.uint64(2**64 - 1), 2**64 - 1),
    "numpy bool": (np.bool_(True), True),
    "numpy str": (np.str_("x"), "x"),
    "numpy float16": (np.float16(0.25), 0.25),
    "numpy -0.0": (np.float64(-0.0), -0.0),
    "Python NaNs whatever their sign": (float("nan"), _nan("000000000000f8ff")),
    "-0.0 itself": (-0.0, -0.0),
    "int64 array / tensor above 2**53": (np.array([2**53 + 1]), torch.tensor([2**53 + 1])),
    "big-endian / native": (np.array([1.5, -0.0], dtype=">f8"), np.array([1.5, -0.0], dtype="<f8")),
    "str arrays of 2000": (_big_strings(), _big_strings()),
    "longdouble arrays": (np.array([1.0, -0.0, np.nan], dtype=np.longdouble),
                          np.array([1.0, -0.0, np.nan], dtype=np.longdouble)),
    "datetime arrays": (np.array(["2024-01-01", "NaT"], dtype="M8[s]"), np.array(["2024-01-01", "NaT"], dtype="M8[s]")),
    "structured arrays": (np.array([(1, 2.0)], dtype=[("a", "i8"), ("b", "f8")]),
                          np.array([(1, 2.0)], dtype=[("a", "i8"), ("b", "f8")])),
    "object arrays": (np.array([1, "x", None], dtype=object), np.array([1, "x", None], dtype=object)),
    "tensor NaN, same bits": (torch.tensor([float("nan"), -0.0]), torch.tensor([float("nan"), -0.0])),
    "sets": ({1, "a"}, {"a", 1}),
    "None, dtypes": ([None, torch.float16], [None, torch.float16]),
}


@pytest.mark.parametrize("a, b", list(_EQUAL.values()), ids=list(_EQUAL))
def test_intended_normalisations_stay_equal(a, b):
    assert value_difference(a, b) is None and value_difference(b, a) is None


def test_a_depth_bomb_is_a_clear_error_not_a_recursion_error():
    from liferaft.tools.diff import MAX_VALUE_DEPTH, ValueTooDeepError

    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(ValueTooDeepError, match=f"deeper than {MAX_VALUE_DEPTH} levels"):
        value_difference(deep, deep)
    loop: list = []
    loop.append(loop)
    with pytest.raises(liferaft.LiferaftError, match="contain themselves"):
        value_difference(loop, loop)
    fine: list = []
    for _ in range(MAX_VALUE_DEPTH - 1):
        fine = [fine]
    assert value_difference(fine, fine) is None


def test_diff_of_real_checkpoints_finds_every_exact_difference(tmp_path, capsys):
    big_a, big_b = _big_strings(), _big_strings(1000)
    a = {"w": torch.zeros(2), "ids": np.array([2**53, 7], dtype=np.int64), "names": big_a, "flag": True,
         "one": 1, "zero": 0.0, "same": {"k": [1, 2.5, "x"]},
         "t64": torch.tensor([2**53, 7]), "tz": torch.tensor([0.0, 1.0]), "tf": torch.tensor([1.0, 2.0])}
    b = {"w": torch.zeros(2), "ids": np.array([2**53 + 1, 7], dtype=np.int64), "names": big_b, "flag": 1,
         "one": 1.0, "zero": -0.0, "same": {"k": [1, 2.5, "x"]},
         "t64": torch.tensor([2**53 + 1, 7]), "tz": torch.tensor([-0.0, 1.0]), "tf": torch.tensor([1.0, 2.0 + 1e-3])}
    liferaft.save(str(tmp_path / "a"), a)
    liferaft.save(str(tmp_path / "b"), b)
    r = liferaft.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    status = {k.key: k.status for k in r.keys}
    assert status == {"w": "equal", "same": "equal", "ids": "changed", "names": "changed", "flag": "changed",
                      "one": "changed", "zero": "changed", "t64": "changed", "tz": "changed", "tf": "changed"}
    got = {k.key: k for k in r.keys}
    assert got["t64"].max_abs == 1.0                         # exact, not float64's 0
    assert got["tz"].max_abs == 0.0 and "-0.0 vs 0.0" in got["tz"].detail
    # a tolerance is for float drift: integers stay exact, -0.0 and a small float change pass
    r = liferaft.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["t64", "tz", "tf"], tolerance=10.0)
    assert {k.key: k.status for k in r.keys} == {"t64": "changed", "tz": "equal", "tf": "equal"}
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "changed  flag  the value: True vs 1" in out
    assert "changed  names  the value: arrays differ at [1000]" in out
    assert "identical" not in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
