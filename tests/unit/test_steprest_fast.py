"""The per-step log's cheap walk of the rest of the state (``tiers.steprest.RestCapture``) records exactly what
the full walk of a save records: the same keys, tensors and values, step after step, also after the state's
structure changes (a parameter group added, a buffer registered), and with objects it has no cheap walk for."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from liferaft.state import optsteps
from liferaft.tiers.steprest import RestCapture, capture_rest


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


class Extra(nn.Linear):
    """A module with extra state (no cheap walk for it)."""

    def get_extra_state(self) -> Any:
        return {"calls": 3}

    def set_extra_state(self, state: Any) -> None:
        pass


def _put(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype), "shape": list(t.shape), "bytes": t.contiguous().view(-1).view(torch.uint8).tolist()}


def _state(model: nn.Module) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
            "count": Counter(), "step": 0}


def _train(st: dict[str, Any], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    st["model"](torch.randn(3, 4, generator=g)).square().sum().backward()
    st["optim"].step()
    st["optim"].zero_grad()
    st["sched"].step()
    st["count"].n += 1
    st["step"] = step


def _check(st: dict[str, Any], rc: RestCapture, steps: range) -> None:
    for step in steps:
        _train(st, step)
        live = optsteps.tensor_ids([st["optim"]])
        assert rc.capture(st, live, _put, False) == capture_rest(st, live, _put, False), step


def test_cheap_walk_records_what_the_full_walk_records():
    st = _state(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    rc = RestCapture()
    _check(st, rc, range(3))
    assert rc.fast is not None                      # modules without buffers, optimizers: cheap from now on
    rest = rc.capture(st, optsteps.tensor_ids([st["optim"]]), _put, False)
    assert any("lr" in k for k in rest["values"]) and rest["values"]     # the scheduled lr is recorded

    extra = nn.Parameter(torch.ones(2))             # the structure changes: checked again, still the same
    st["optim"].add_param_group({"params": [extra], "lr": 0.5})
    st["model"].register_parameter("extra", extra)
    _check(st, rc, range(3, 5))
    st["model"].register_buffer("seen", torch.arange(3.0))
    _check(st, rc, range(5, 7))
    rest = rc.capture(st, optsteps.tensor_ids([st["optim"]]), _put, False)
    assert any(k.endswith("seen") for k in rest["tensors"])            # a new buffer is in the record


def test_objects_without_a_cheap_walk_are_walked_in_full():
    st = _state(nn.Sequential(Extra(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    rc = RestCapture()
    _check(st, rc, range(4))
    rest = rc.capture(st, optsteps.tensor_ids([st["optim"]]), _put, False)
    assert any("running_mean" in k for k in rest["tensors"])
    assert any("_extra_state" in k for k in rest["values"]), list(rest["values"])
