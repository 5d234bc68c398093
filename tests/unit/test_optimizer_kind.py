"""Another kind of optimizer's checkpoint is a mismatch (issue 14, review item 6).

The rule that an optimizer's state absent from the checkpoint is consistent with a parameter the live optimizer
never stepped (``state.matching``, rule 1) holds only for a checkpoint of the same kind of optimizer: an SGD
checkpoint holds no ``exp_avg`` for any parameter, which is not "AdamW never stepped them". Strict loads refuse
it (before anything is loaded: the param_groups keys differ, and the AdamW state is missing), and a non-strict
one keeps the live optimizer's param_groups, so it still steps. Checkpoints written before the optimizer's class
was recorded are judged by their state keys and param_groups keys.
"""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

import liferaft
from liferaft.storage import resolve


def sgd_checkpoint(path: str) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 3)).sum().backward()
    sgd.step()
    liferaft.save(path, {"model": m, "optim": sgd})


def adamw():
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def drop_classes(path: str) -> None:
    """Rewrite the manifest as a checkpoint written before containers recorded their class."""
    st = resolve(path)
    marker = json.loads(st.read_all("COMMIT"))
    doc = json.loads(st.read_all(marker["manifest"]))
    for c in doc["containers"]:
        c.pop("class", None)
    data = json.dumps(doc).encode()
    st.put_atomic(marker["manifest"], data)
    marker["manifest_size"], marker["manifest_hash"] = len(data), xxhash.xxh3_64_hexdigest(data)
    st.put_atomic("COMMIT", json.dumps(marker).encode())


@pytest.mark.parametrize("recorded", [True, False], ids=["class-recorded", "old-checkpoint"])
def test_an_sgd_checkpoint_does_not_load_into_adamw(tmp_path, recorded):
    path = str(tmp_path / "ck")
    sgd_checkpoint(path)
    if not recorded:
        drop_classes(path)
    m, opt = adamw()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(liferaft.StateMismatchError, match=r"'optim.param_groups'.*lack \['amsgrad', 'betas'.*"
                                                           r"only the checkpoint's have \['dampening', 'momentum'"):
        liferaft.load(path, {"model": m, "optim": opt})
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))      # nothing was loaded
    assert not opt.state
    res = liferaft.load(path, {"model": m, "optim": opt}, strict=False)
    assert "optim.state.weight.exp_avg" in res.missing_keys and "optim.param_groups" in res.missing_keys
    assert "optim.state.weight.momentum_buffer" in res.unexpected_keys
    assert "betas" in opt.param_groups[0]
    m(torch.randn(4, 3)).sum().backward()
    opt.step()                                                  # the live optimizer still works


def test_the_class_alone_decides_where_param_groups_keys_agree(tmp_path):
    """An Adam checkpoint with every parameter's state holds all AdamW needs: the class only decides for the
    parameters whose state the checkpoint lacks."""
    path = str(tmp_path / "ck")
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, 3)).sum().backward()
    adam.step()
    liferaft.save(path, {"model": m, "optim": adam})
    m2, opt = adamw()
    if sorted(adam.param_groups[0]) == sorted(opt.param_groups[0]):
        liferaft.load(path, {"model": m2, "optim": opt})          # same state keys: loads
        assert torch.equal(opt.state[m2.weight]["exp_avg"], adam.state[m.weight]["exp_avg"])


def test_an_adamw_checkpoint_with_a_never_stepped_parameter_still_loads(tmp_path):
    path = str(tmp_path / "ck")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m[0](torch.randn(4, 3)).sum().backward()                    # m[1] gets no gradient: no state
    opt.step()
    liferaft.save(path, {"model": m, "optim": opt})
    for recorded in (True, False):
        if not recorded:
            drop_classes(path)
        torch.manual_seed(1)
        m2 = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2))
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
        liferaft.load(path, {"model": m2, "optim": opt2})
        assert set(opt2.state) == {m2[0].weight, m2[0].bias}


def test_groups_a_scheduler_extended_load_into_an_optimizer_without_one(tmp_path):
    """A run with an LR scheduler (its param groups hold ``initial_lr``) loaded for fine-tuning or evaluation into
    the same optimizer without a scheduler: no mismatch, as torch's own load_state_dict (helper-113: refused as
    "another kind of optimizer"). The reverse — the live optimizer's scheduler would read keys the load removes —
    is refused naming the scheduler's keys."""
    m = torch.nn.Linear(4, 3)
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(o, 2)
    m(torch.ones(2, 4)).sum().backward()
    o.step()
    sched.step()
    liferaft.save(str(tmp_path / "with"), {"model": m, "optim": o})
    m2 = torch.nn.Linear(4, 3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    liferaft.load(str(tmp_path / "with"), {"model": m2, "optim": o2})
    assert o2.param_groups[0]["lr"] == 0.1 and torch.equal(o2.state[m2.weight]["exp_avg"], o.state[m.weight]["exp_avg"])
    o2.step()
    m3 = torch.nn.Linear(4, 3)
    liferaft.save(str(tmp_path / "without"), {"model": m3, "optim": torch.optim.AdamW(m3.parameters())})
    m4 = torch.nn.Linear(4, 3)
    o4 = torch.optim.AdamW(m4.parameters())
    torch.optim.lr_scheduler.OneCycleLR(o4, 1.0, total_steps=10)
    with pytest.raises(liferaft.StateMismatchError, match="max_lr.*scheduler"):
        liferaft.load(str(tmp_path / "without"), {"model": m4, "optim": o4})
