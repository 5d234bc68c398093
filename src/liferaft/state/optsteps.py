"""Optimizer steps as data: what one ``optimizer.step()`` consumed, captured before it runs and replayed later.

The per-step log (``liferaft.tiers.steplog``) records, for every ``optimizer.step()`` call, each parameter's local
gradient, the param groups' hyperparameters and the tensor keyword arguments; replaying the same deterministic
step on the same inputs gives the same parameters and optimizer state, bit for bit. This module is the part that
knows optimizers and DTensor: finding the optimizers in a state, the layout fingerprint a log is valid for, the
local tensor of a gradient, and one replayed call. No I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

from liferaft.errors import InvalidStateError
from liferaft.state.dtypes import dtype_name


def find_optimizers(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state`` (dicts, lists and tuples walked, in order; each object once)."""
    out: list[torch.optim.Optimizer] = []
    seen: set[int] = set()

    def walk(v: Any, depth: int) -> None:
        if id(v) in seen or depth > 100:
            return
        seen.add(id(v))
        if isinstance(v, torch.optim.Optimizer):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, depth + 1)
        elif type(v) in (list, tuple):
            for x in v:
                walk(x, depth + 1)

    walk(state, 0)
    return out


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    if is_dtensor(t):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of ``opt`` in group order (the order a record lists their gradients in)."""
    return [p for g in opt.param_groups for p in g["params"]]


def layout_of(optimizers: list[torch.optim.Optimizer], world: int) -> tuple[str, str]:
    """(fingerprint, a short description) of the layout a step record replays into: the world size, each
    optimizer's class, and each parameter's local shape, dtype, global shape and placements."""
    desc = {"world": world, "optimizers": []}
    for opt in optimizers:
        params = []
        for p in params_of(opt):
            local = local_of(p)
            params.append([list(local.shape), dtype_name(local.dtype), list(p.shape),
                           [str(x) for x in p.placements] if is_dtensor(p) else None])
        desc["optimizers"].append({"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                                   "groups": [len(g["params"]) for g in opt.param_groups], "params": params})
    text = json.dumps(desc, sort_keys=True)
    n = sum(len(o["params"]) for o in desc["optimizers"])
    return hashlib.sha256(text.encode()).hexdigest()[:32], f"world {world}, {len(optimizers)} optimizer(s), {n} params"


def hook_optimizers(optimizers: list[torch.optim.Optimizer],
                    capture: Callable[[int, torch.optim.Optimizer, tuple, dict], None]) -> list[Any]:
    """Register ``capture(index, optimizer, args, kwargs)`` as a step pre-hook of each optimizer (torch's own hook
    API): it runs inside ``step()``, after GradScaler's unscale and any clipping, before the update. Returns the
    handles (``.remove()`` them to unhook)."""
    handles = []
    for i, opt in enumerate(optimizers):
        def hook(o: Any, args: tuple, kwargs: dict, i: int = i) -> None:
            capture(i, o, args, kwargs)
        handles.append(opt.register_step_pre_hook(hook))
    return handles


#: Attributes GradScaler.step sets on an optimizer with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) for
#: the length of one ``step()`` instead of passing keyword arguments: the scale the gradients still carry (None:
#: unscaled already) and the inf/NaN flag that makes the step a no-op. torch deletes them after the step.
AMP_ATTRS = ("grad_scale", "found_inf")


def amp_attrs(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``AMP_ATTRS`` set on ``opt`` now (inside its ``step()``: what the fused kernel will read)."""
    return {k: getattr(opt, k) for k in AMP_ATTRS if hasattr(opt, k)}


def grad_for(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The gradient to set on ``p`` from the recorded local gradient ``local`` (on ``p``'s device; for a DTensor
    parameter a DTensor with its mesh and placements)."""
    local = local.to(device=local_of(p).device)
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


def replay_call(opt: torch.optim.Optimizer, grads: list[torch.Tensor | None], groups: list[dict[str, Any]],
                kwargs: dict[str, Any], attrs: dict[str, Any] | None = None) -> None:
    """One recorded ``opt.step(**kwargs)``: set every parameter's gradient (None: none), the groups'
    hyperparameters as they were and the recorded ``AMP_ATTRS`` (``attrs``; those not recorded are absent during
    the step, the ones set before put back after it), step, then clear the gradients. Local: no collective (the
    step of a sharded optimizer on DTensor shards is elementwise)."""
    params = params_of(opt)
    if len(grads) != len(params) or len(groups) != len(opt.param_groups):
        raise InvalidStateError(f"{type(opt).__qualname__}: the step record lists {len(grads)} gradients in "
                                f"{len(groups)} groups, the optimizer has {len(params)} in {len(opt.param_groups)}")
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else grad_for(p, g)
        for group, hyper in zip(opt.param_groups, groups, strict=True):
            for k, v in hyper.items():
                if k != "params":
                    group[k] = v
    device = local_of(params[0]).device if params else torch.device("cpu")
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (attrs or {}).items()}
    before = amp_attrs(opt)
    for k in AMP_ATTRS:
        if k in moved:
            setattr(opt, k, moved[k])
        elif hasattr(opt, k):
            delattr(opt, k)
    try:
        opt.step(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    finally:
        for k in AMP_ATTRS:
            if k in before:
                setattr(opt, k, before[k])
            elif hasattr(opt, k):
                delattr(opt, k)
    for p in params:
        p.grad = None


def tensor_ids(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """``data_ptr`` of the local tensor of every parameter and optimizer-state tensor of ``optimizers``: the state
    a replay rebuilds, which a step record therefore leaves out."""
    out = set()
    for opt in optimizers:
        for p in params_of(opt):
            out.add(local_of(p).data_ptr())
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    out.add(local_of(v).data_ptr())
    out.discard(0)
    return out


class LiveIds:
    """``tensor_ids(optimizers)``, computed at the first membership test."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers, self.ids = optimizers, None

    def __contains__(self, ptr: object) -> bool:
        if self.ids is None:
            self.ids = tensor_ids(self.optimizers)
        return ptr in self.ids


__all__ = [
    "AMP_ATTRS",
    "LiveIds",
    "amp_attrs",
    "find_optimizers",
    "grad_for",
    "hook_optimizers",
    "is_dtensor",
    "layout_of",
    "local_of",
    "params_of",
    "replay_call",
    "tensor_ids",
]
