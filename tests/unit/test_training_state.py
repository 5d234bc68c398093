"""Training states beyond a plain model: tied weights, frozen parameters, non-persistent buffers, optimizer
flavours, LR schedulers, a gradient scaler, several models in one state. Each case: train, save, load into a
fresh copy, train on in both, and compare bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import liferaft


class Tied(nn.Module):
    """Embedding and output head share one weight; a frozen layer; a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.frozen = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scratch.add_(1)
        return self.head(torch.relu(self.mid(self.frozen(self.emb(ids)))))


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-groups": lambda p: torch.optim.AdamW([{"params": p[:1], "lr": 1e-2},
                                                 {"params": p[1:], "lr": 3e-3, "weight_decay": 0.0}]),
}


def make(opt_name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Tied()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[opt_name](params)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    return {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "step": 0}


def step(state, i: int) -> float:
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(i))
    loss = state["model"](ids).pow(2).mean()
    state["scaler"].scale(loss).backward()
    state["scaler"].step(state["optim"])
    state["scaler"].update()
    state["optim"].zero_grad()
    state["sched"].step()
    state["step"] = i + 1
    return float(loss.detach())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_resume_is_bitwise_with_tied_frozen_buffers_schedulers_and_scaler(tmp_path, opt_name):
    state = make(opt_name)
    for i in range(5):
        step(state, i)
    liferaft.save(str(tmp_path / "ck"), state)
    keys = {t.key for t in liferaft.inspect(str(tmp_path / "ck")).tensors}
    assert "model.calls" in keys and not any("scratch" in k for k in keys)     # non-persistent: not saved
    assert "model.frozen.weight" in keys
    reference = copy.deepcopy(state)
    fresh = make(opt_name, seed=1)
    liferaft.load(str(tmp_path / "ck"), fresh)
    assert fresh["model"].head.weight is fresh["model"].emb.weight              # still tied
    assert not fresh["model"].frozen.weight.requires_grad
    assert fresh["step"] == 5 and fresh["scaler"].get_scale() == reference["scaler"].get_scale()
    assert fresh["sched"].get_last_lr() == reference["sched"].get_last_lr()
    for i in range(5, 9):
        assert step(fresh, i) == step(reference, i)
    for (k, a), (_, b) in zip(fresh["model"].state_dict().items(), reference["model"].state_dict().items()):
        assert torch.equal(a, b), k
    assert [g["lr"] for g in fresh["optim"].param_groups] == [g["lr"] for g in reference["optim"].param_groups]


def test_several_models_saved_together_and_loaded_one_at_a_time(tmp_path):
    torch.manual_seed(0)
    actor, critic, ref = nn.Linear(6, 3), nn.Linear(6, 1), nn.Linear(6, 3)
    rl = {"actor": {"model": actor, "optim": torch.optim.Adam(actor.parameters())},
          "critic": {"model": critic, "optim": torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.5)},
          "reference": ref, "iteration": 12}
    x = torch.randn(5, 6)
    for part in ("actor", "critic"):
        rl[part]["model"](x).sum().backward()
        rl[part]["optim"].step()
    liferaft.save(str(tmp_path / "rl"), rl)
    torch.manual_seed(1)
    actor2 = nn.Linear(6, 3)
    only_actor = {"actor": {"model": actor2, "optim": torch.optim.Adam(actor2.parameters())}}
    with pytest.raises(liferaft.StateMismatchError, match="critic"):
        liferaft.load(str(tmp_path / "rl"), only_actor)                             # strict by default
    res = liferaft.load(str(tmp_path / "rl"), only_actor, strict=False)
    assert torch.equal(actor2.weight, actor.weight)
    assert only_actor["actor"]["optim"].state_dict()["state"][0]["step"] == 1
    assert any(k.startswith("critic.") for k in res.unexpected_keys) and "iteration" in res.unexpected_keys
    ref2 = nn.Linear(6, 3)
    liferaft.load(str(tmp_path / "rl"), {"reference": ref2}, strict=False)
    assert torch.equal(ref2.weight, ref.weight)
