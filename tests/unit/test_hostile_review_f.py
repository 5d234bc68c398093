"""Hostile review F (loads that returned a silently wrong state), each finding as a class of input: an optimizer
whose parameters are grouped otherwise than when it was saved (merged groups, regrouped, a group added) took one
group's hyperparameters for another's parameters, or left a group without any."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.errors import StateMismatchError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _by_layer(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": list(m[0].parameters()), "lr": 0.1, "weight_decay": 0.01},
                              {"params": list(m[1].parameters()), "lr": 0.2, "weight_decay": 0.5}])


def _saved(tmp_path) -> str:
    m = _model()
    o = _by_layer(m)
    m(torch.randn(3, 4)).sum().backward()
    o.step()
    liferaft.save(str(tmp_path / "ck"), {"model": m, "optim": o})
    return str(tmp_path / "ck")


def _groups(m: torch.nn.Module, o: torch.optim.Optimizer) -> list[tuple[list[str], float, float]]:
    name = {id(p): n for n, p in m.named_parameters()}
    return [(sorted(name[id(p)] for p in g["params"]), g["lr"], g["weight_decay"]) for g in o.param_groups]


REGROUPINGS = {
    "merged": lambda m: torch.optim.AdamW(m.parameters(), lr=1.0),
    "weights_and_biases": lambda m: torch.optim.AdamW([{"params": [m[0].weight, m[1].weight], "lr": 3.0},
                                                       {"params": [m[0].bias, m[1].bias], "lr": 4.0}]),
    "split": lambda m: torch.optim.AdamW([{"params": [m[0].weight], "lr": 3.0}, {"params": [m[0].bias], "lr": 4.0},
                                          {"params": list(m[1].parameters()), "lr": 5.0}]),
}


@pytest.mark.parametrize("regroup", sorted(REGROUPINGS))
def test_a_strict_load_into_otherwise_grouped_parameters_is_refused_before_anything_changes(tmp_path, regroup):
    ck = _saved(tmp_path)
    m = _model()
    o = REGROUPINGS[regroup](m)
    before = [p.detach().clone() for p in m.parameters()]
    groups = _groups(m, o)
    with pytest.raises(StateMismatchError, match="group the parameters otherwise"):
        liferaft.load(ck, {"model": m, "optim": o})
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and _groups(m, o) == groups
    assert not o.state


def test_not_strict_each_live_group_takes_the_saved_group_of_its_parameters_or_keeps_its_own(tmp_path):
    ck = _saved(tmp_path)
    m = _model()
    o = REGROUPINGS["split"](m)             # layer 1 grouped as saved; layer 0 split in two
    r = liferaft.load(ck, {"model": m, "optim": o}, strict=False)
    assert "optim.param_groups" in r.missing_keys
    assert _groups(m, o) == [(["0.weight"], 3.0, 0.01), (["0.bias"], 4.0, 0.01), (["1.bias", "1.weight"], 0.2, 0.5)]
    m(torch.randn(3, 4)).sum().backward()
    o.step()                                # every group has every hyperparameter


def test_a_group_added_for_new_parameters_keeps_its_own_hyperparameters(tmp_path):
    ck = _saved(tmp_path)
    m = _model()
    m.append(torch.nn.Linear(2, 2))         # fine-tuning: a new head, in a group of its own
    o = _by_layer(m)
    o.add_param_group({"params": list(m[2].parameters()), "lr": 0.7})
    r = liferaft.load(ck, {"model": m, "optim": o}, strict=False)
    assert {"optim.param_groups", "model.2.weight"} <= set(r.missing_keys)
    assert [(g["lr"], g["weight_decay"]) for g in o.param_groups] == [(0.1, 0.01), (0.2, 0.5), (0.7, 0.01)]
    assert all("betas" in g for g in o.param_groups)


def test_groups_in_another_order_or_their_parameters_permuted_still_load_exactly(tmp_path):
    ck = _saved(tmp_path)
    m = _model()
    o = torch.optim.AdamW([{"params": [m[1].bias, m[1].weight], "lr": 9.0}, {"params": [m[0].bias, m[0].weight]}])
    liferaft.load(ck, {"model": m, "optim": o})
    assert sorted(_groups(m, o)) == [(["0.bias", "0.weight"], 0.1, 0.01), (["1.bias", "1.weight"], 0.2, 0.5)]


@pytest.mark.parametrize(("per_rank", "held"), [([5], [1]), ([5], []), ([5], [0, 0]), ([5], "0"), (None, [0])],
                         ids=["beyond_world", "no_rank", "repeated", "not_a_list", "without_per_rank"])
def test_a_crafted_held_list_of_a_value_is_refused(tmp_path, per_rank, held):
    from liferaft.errors import CorruptCheckpointError
    from liferaft.testing import tamper

    path = str(tmp_path / "ck")
    liferaft.save(path, {"v": 5})

    def edit(doc):
        v = next(v for v in doc["values"] if v["key"] == "v")
        if per_rank is not None:
            v.pop("value", None)
            v["per_rank"] = per_rank
        v["held"] = held
    tamper.rewrite_manifest(path, edit)
    with pytest.raises(CorruptCheckpointError, match="'v'"):
        liferaft.read(path)


class _Tiable(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight


@pytest.mark.parametrize("source", ["liferaft", "dcp"])
def test_keys_tied_in_the_state_but_different_in_the_checkpoint_are_refused(tmp_path, source):
    torch.manual_seed(0)
    untied = _Tiable(tie=False)
    path = str(tmp_path / "ck")
    if source == "dcp":
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": untied.state_dict()}, checkpoint_id=path)
    else:
        liferaft.save(path, {"model": untied})
    tied = _Tiable(tie=True)
    before = tied.emb.weight.detach().clone()
    with pytest.raises(StateMismatchError, match="'model.emb.weight' and 'model.head.weight' are one tensor"):
        liferaft.load(path, {"model": tied})
    assert torch.equal(tied.emb.weight, before)
    t = torch.zeros(3)                              # plain tensors tied the same way
    liferaft.save(str(tmp_path / "p"), {"a": torch.ones(3), "b": torch.full((3,), 2.0)})
    with pytest.raises(StateMismatchError, match="one tensor in the state"):
        liferaft.load(str(tmp_path / "p"), {"a": t, "b": t})


def test_keys_tied_in_the_state_load_when_the_checkpoint_holds_them_equal(tmp_path):
    torch.manual_seed(0)
    saved = _Tiable(tie=True)
    liferaft.save(str(tmp_path / "tied"), {"model": saved})          # a tied model's save: equal by its hashes
    again = _Tiable(tie=True)
    liferaft.load(str(tmp_path / "tied"), {"model": again})
    assert torch.equal(again.emb.weight, saved.emb.weight) and again.head.weight is again.emb.weight
    w = torch.randn(5)                              # stored apart, equal values: read and compared
    liferaft.save(str(tmp_path / "apart"), {"a": w.clone(), "b": w.clone()},
                  options=liferaft.SaveOptions(compression="on"))
    t = torch.zeros(5)
    liferaft.load(str(tmp_path / "apart"), {"a": t, "b": t})
    assert torch.equal(t, w)
