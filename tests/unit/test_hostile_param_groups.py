"""An optimizer's ``param_groups`` in a checkpoint read as hostile input (``state.matching``): a value that is no
list of groups with lists of parameter names (or indices) is a CorruptCheckpointError naming the key, with nothing
loaded; groups that leave a live group none of its parameters (torch's loader would leave it without lr or betas:
the next ``step()`` fails) are refused when strict and, when not, leave that group's hyperparameters as they are;
what users do legitimately still loads: a group of saved and new parameters (a layer unfrozen for a second stage),
an optimizer no one module owns (its groups hold parameter indices)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import liferaft
from liferaft.errors import CorruptCheckpointError, StateMismatchError
from liferaft.testing.tamper import rewrite_manifest


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    o = torch.optim.AdamW([{"params": m[0].parameters(), "lr": 0.01}, {"params": m[1].parameters(), "lr": 0.02}])
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    return {"model": m, "optim": o}


def _crafted(tmp_path, edit) -> str:
    path = str(tmp_path / "ck")
    liferaft.save(path, _state())

    def change(doc: dict) -> None:
        entry = next(v for v in doc["values"] if v["key"] == "optim.param_groups")
        entry["value"] = edit(copy.deepcopy(entry["value"]))

    rewrite_manifest(path, change)
    return path


def _snapshot(st: dict) -> tuple:
    return ([t.clone() for t in st["model"].parameters()], copy.deepcopy(st["optim"].state_dict()["param_groups"]))


def _set(group: int, key: str, value):
    def edit(groups):
        groups[group][key] = value
        return groups
    return edit


@pytest.mark.parametrize("edit", [
    lambda g: 5, lambda g: None, lambda g: "groups", lambda g: {"params": []}, lambda g: [1], lambda g: [g[0], [g[1]]],
    _set(0, "params", 7), _set(0, "params", None), _set(1, "params", [True, 2.5]), _set(1, "params", {"a": 1}),
    lambda g: [{k: v for k, v in g[0].items() if k != "params"}, g[1]],
], ids=["int", "none", "str", "dict", "int-group", "list-group", "params-int", "params-none", "params-bool-float",
        "params-dict", "no-params"])
@pytest.mark.parametrize("strict", [True, False])
def test_malformed_param_groups_are_refused_naming_the_key_with_nothing_loaded(tmp_path, edit, strict):
    path = _crafted(tmp_path, edit)
    st = _state(seed=1)
    before = _snapshot(st)
    with pytest.raises(CorruptCheckpointError, match="optim.param_groups"):
        liferaft.load(path, st, strict=strict)
    after = _snapshot(st)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)) and before[1] == after[1]


@pytest.mark.parametrize("edit", [
    _set(0, "params", []), _set(0, "params", ["nope.weight", "nope.bias"]), _set(0, "params", [0, 1]),
    lambda g: [g[1]],                                                   # a whole live group in none
], ids=["empty", "unknown-names", "indices-for-names", "group-left-out"])
def test_groups_that_leave_a_live_group_out_are_refused_when_strict_and_kept_when_not(tmp_path, edit):
    path = _crafted(tmp_path, edit)
    st = _state(seed=1)
    with pytest.raises(StateMismatchError, match="optim.param_groups"):
        liferaft.load(path, st)
    st = _state(seed=1)
    r = liferaft.load(path, st, strict=False)
    assert "optim.param_groups" in r.missing_keys
    for g in st["optim"].param_groups:                   # every group keeps hyperparameters: the next step runs
        assert {"lr", "betas", "eps", "weight_decay"} <= set(g)
    st["model"](torch.randn(2, 4)).sum().backward()
    st["optim"].step()


def test_well_formed_groups_still_load_exactly(tmp_path):
    path = _crafted(tmp_path, lambda g: g)
    st = _state(seed=1)
    liferaft.load(path, st)
    assert [g["lr"] for g in st["optim"].param_groups] == [0.01, 0.02]


def test_a_group_of_saved_and_new_parameters_takes_the_saved_hyperparameters_strictly(tmp_path):
    """A second stage unfreezes a layer into the one AdamW group: the stage-1 checkpoint's group holds the other
    layer's parameters only, and its hyperparameters reach the whole live group (torch maps it so)."""
    def make(second: bool) -> dict:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        params = list(m.parameters()) if second else list(m[0].parameters())
        return {"model": m, "optim": torch.optim.AdamW(params, lr=3e-4 if not second else 1.0)}

    st = make(False)
    st["model"](torch.randn(2, 4)).sum().backward()
    st["optim"].step()
    liferaft.save(tmp_path / "ck", st)
    live = make(True)
    r = liferaft.load(tmp_path / "ck", live, strict=False)
    assert "optim.param_groups" not in r.missing_keys and live["optim"].param_groups[0]["lr"] == 3e-4
    live["model"](torch.randn(2, 4)).sum().backward()
    live["optim"].step()


def test_an_optimizer_no_module_owns_keeps_its_index_keyed_groups(tmp_path):
    """``{"enc": enc, "dec": dec, "optim": AdamW(both)}``: saved by parameter index, loaded back as it was."""
    import warnings

    def make() -> dict:
        torch.manual_seed(0)
        enc, dec = nn.Linear(4, 3), nn.Linear(3, 2)
        return {"enc": enc, "dec": dec, "optim": torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=0.03)}

    st = make()
    st["dec"](st["enc"](torch.randn(2, 4))).sum().backward()
    st["optim"].step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # (the warning that it is saved by index)
        liferaft.save(tmp_path / "ck", st)
        live = make()
        live["dec"](live["enc"](torch.randn(2, 4))).sum().backward()
        live["optim"].step()                    # (a state to load into: by index, no placeholders are made)
        live["optim"].param_groups[0]["lr"] = 1.0
        liferaft.load(tmp_path / "ck", live)
    assert live["optim"].param_groups[0]["lr"] == 0.03
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
               zip(live["optim"].state.values(), st["optim"].state.values(), strict=True))
