"""Rank functions for DDP and pipeline-style ownership (imported as ``multiproc._layouts_ranks``)."""

from __future__ import annotations

import torch
from torch import nn

import liferaft


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(i))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _flat(ddp: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[float]]:
    out = {k: v.flatten().tolist() for k, v in ddp.module.state_dict().items()}
    out.update({f"momentum{i}": s["momentum_buffer"].flatten().tolist() for i, s in enumerate(opt.state.values())})
    return out


def ddp_train_save(rank: int, world: int, path: str) -> tuple[dict, dict]:
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        _step(ddp, opt, i)
    liferaft.save(path, {"model": ddp, "optim": opt, "step": 3})
    saved = _flat(ddp, opt)
    for i in range(3, 5):                                   # the reference continuation
        _step(ddp, opt, i)
    return saved, _flat(ddp, opt)


def ddp_load_continue(rank: int, world: int, path: str) -> tuple[dict, dict]:
    torch.manual_seed(123)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = {"model": ddp, "optim": opt, "step": 0}
    liferaft.load(path, state)
    assert state["step"] == 3
    loaded = _flat(ddp, opt)
    for i in range(3, 5):
        _step(ddp, opt, i)
    return loaded, _flat(ddp, opt)


def stage_of(rank: int) -> nn.Module:
    torch.manual_seed(10 + rank)
    return nn.Linear(8, 8)


def pipeline_save(rank: int, world: int, path: str) -> list[float]:
    """Rank r owns stage r only (keys only that rank has)."""
    stage = stage_of(rank)
    liferaft.save(path, {"stages": {str(rank): stage}, "micro_batches": 4})
    return stage.weight.flatten().tolist()


def pipeline_load(rank: int, world: int, path: str) -> list[float]:
    stage = nn.Linear(8, 8)
    liferaft.load(path, {"stages": {str(rank): stage}, "micro_batches": 0})
    return stage.weight.flatten().tolist()


def tied_ddp(rank: int, world: int, path: str, phase: str, opt_name: str) -> dict[str, list[float]]:
    """The model of tests/unit/test_training_state.py (tied weights, a frozen layer, persistent and non-persistent
    buffers, optimizer + OneCycleLR + GradScaler) under DDP: "save" trains 5 steps, saves, and returns the state
    after 4 more steps; "resume" (a new job) loads and trains the same 4 steps."""
    from unit.test_training_state import make, step

    state = make(opt_name, seed=0 if phase == "save" else 1)
    state["model"] = nn.parallel.DistributedDataParallel(state["model"])
    if phase == "save":
        for i in range(5):
            step(state, i)
        liferaft.save(path, state)
    else:
        liferaft.load(path, state)
        assert state["model"].module.head.weight is state["model"].module.emb.weight
    for i in range(5, 9):
        step(state, i)
    return {k: v.flatten().tolist() for k, v in state["model"].module.state_dict().items()}
