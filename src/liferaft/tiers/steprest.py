"""The rest of the state in a step record: everything a replay of the optimizer steps does not rebuild.

Parameters and the optimizer-state tensors of the tracked optimizers are rebuilt by replaying the recorded steps;
everything else in the state (model buffers, the data position, RNG streams, schedulers, a GradScaler, the
optimizers' hyperparameters and step counters outside tensors, user values) is small and recorded in full after
every step. Captured through ``state.flatten`` (the same walk a save makes) and put back the way a load does:
tensors copied into the live ones, plain values assigned, then every stateful object's ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import torch

from liferaft.core.load import _assign
from liferaft.errors import StateMismatchError
from liferaft.state.adapters import ModuleAdapter, OptimizerAdapter
from liferaft.state.flatten import FlatState, flatten
from liferaft.state.values import as_leaf, decode_value, encode_value
from liferaft.tiers.steprecord import Header, tensor_at


def _split(flat: FlatState, live: Container[int]) -> tuple[dict[str, list[torch.Tensor]], list[tuple[str, Any]]]:
    """The rest of a flattened state: its tensors not in ``live`` (local parts), and its plain values."""
    tensors: dict[str, list[torch.Tensor]] = {}
    for leaf in flat.tensors:
        parts = [t for _, t in leaf.parts]
        if all(t.numel() == 0 or t.data_ptr() in live for t in parts):
            continue
        tensors[leaf.key] = [t.detach() for t in parts]
    return tensors, [(key, v) for key, _, v in flat.values]


def capture_rest(state: Any, live: Container[int], put: Callable[[torch.Tensor], dict[str, Any]],
                 allow_pickle: bool) -> dict[str, Any]:
    """The ``rest`` section of a record: tensors not in ``live`` (``data_ptr`` of parameters and optimizer-state
    tensors) stored by ``put`` (one entry per local part), and plain values encoded."""
    return _encode(*_split(flatten(state), live), put, allow_pickle)


def _encode(tensors: dict[str, list[torch.Tensor]], values: list[tuple[str, Any]],
            put: Callable[[torch.Tensor], dict[str, Any]], allow_pickle: bool) -> dict[str, Any]:
    return {"tensors": {k: [put(t) for t in ts] for k, ts in tensors.items()},
            "values": {key: encode_value(v, key, allow_pickle) for key, v in values}}


class _NoState:
    """A module's adapter for the per-step walk when its state dict holds parameters only (all rebuilt by replay)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return {}


class _FastOptimizer:
    """An optimizer's adapter for the per-step walk: torch's own ``state_dict()`` (no copies, no collectives)
    with the parameter indices renamed to the names ``get_optimizer_state_dict`` gave them, less the state's
    tensors (all rebuilt by the replay, never in the record)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.optimizer, self.names = optimizer, names

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        n = self.names
        state = {}
        for k, v in sd["state"].items():        # its tensors are the optimizer's state: rebuilt by the replay
            plain = {key: x for key, x in v.items() if not isinstance(x, torch.Tensor)}
            if plain:
                state[n[k]] = plain
        return {**({"state": state} if state else {}),      # (the full walk has no empty state dict either)
                "param_groups": [{**g, "params": [n[k] for k in g["params"]]} for g in sd["param_groups"]]}


class RestCapture:
    """The rest of the state, captured after every step without the cost of a save's walk.

    A save's walk asks every module and optimizer for ``get_model_state_dict`` / ``get_optimizer_state_dict``
    (milliseconds each, every step), though a module's parameters and an optimizer's state tensors are left out of
    the record anyway. So the first capture (and the first after the state's structure changed: other objects,
    parameters, buffers or optimizer state) walks as a save does **and** with cheap adapters — modules without
    buffers or extra state give nothing, optimizers give torch's own ``state_dict()`` with the parameters named as
    the full walk named them — and compares the two: the same keys, the same tensors, the same values. Only if they
    agree are the cheap adapters used for the following steps; otherwise every step walks in full. What is
    recorded is the same either way (docs/STEPLOG.md).
    """

    def __init__(self) -> None:
        self.signature: Any = None
        self.fast: dict[int, Any] | None = None     # id(obj) -> cheap adapter, once checked
        self.fast_objects: list[Any] = []

    def capture(self, state: Any, live: Container[int], put: Callable[[torch.Tensor], dict[str, Any]],
                allow_pickle: bool) -> dict[str, Any]:
        """The ``rest`` section of a record of ``state`` (as ``capture_rest``)."""
        if self.fast is not None and _signature(self.fast_objects) == self.signature:
            return _encode(*_split(flatten(state, adapters=self.fast), live), put, allow_pickle)
        flat = flatten(state)
        full = _split(flat, live)
        self.fast, self.fast_objects = None, []
        cheap = _cheap_adapters(flat)
        if cheap:
            try:
                quick = _split(flatten(state, adapters=cheap), live)
            except Exception:  # noqa: BLE001 - a cheap walk that fails is not used; the full one stands
                quick = None
            if quick is not None and _same(full, quick):
                self.fast, self.fast_objects = cheap, list(cheap.values())
                self.signature = _signature(self.fast_objects)
        return _encode(*full, put, allow_pickle)


def _cheap_adapters(flat: FlatState) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for _, adapter, sd in flat.statefuls:
        if isinstance(adapter, ModuleAdapter):
            m = adapter.module
            plain = not any(True for _ in m.buffers()) and all(
                type(x).get_extra_state is torch.nn.Module.get_extra_state for x in m.modules())
            if plain:
                out[id(m)] = _NoState(m)
        elif isinstance(adapter, OptimizerAdapter):
            opt = adapter.optimizer
            groups = sd.get("param_groups") if isinstance(sd, dict) else None
            if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
                continue
            names, k = {}, 0
            for g, live in zip(groups, opt.param_groups, strict=True):
                fq = g.get("params") if isinstance(g, dict) else None
                if not isinstance(fq, list) or len(fq) != len(live["params"]):
                    break
                for name in fq:
                    names[k] = name
                    k += 1
            else:
                out[id(opt)] = _FastOptimizer(opt, names)
    return out


def _signature(adapters: list[Any]) -> tuple[Any, ...]:
    """What the cheap adapters' check depends on: parameters and optimizer state per optimizer, buffers and
    parameters per module (a change means checking again)."""
    out: list[Any] = []
    for a in adapters:
        if isinstance(a, _FastOptimizer):
            out.append(tuple(tuple(id(p) for p in g["params"]) for g in a.optimizer.param_groups))
            out.append(tuple((id(p), tuple(s)) for p, s in a.optimizer.state.items()))
        else:
            out.append((sum(1 for _ in a.module.buffers()), tuple(id(p) for p in a.module.parameters())))
    return tuple(out)


def _same(a: tuple[dict[str, list[torch.Tensor]], list[tuple[str, Any]]],
          b: tuple[dict[str, list[torch.Tensor]], list[tuple[str, Any]]]) -> bool:
    """The two walks found the same rest: keys, tensors (same memory, shape, dtype), values."""
    if a[0].keys() != b[0].keys() or [k for k, _ in a[1]] != [k for k, _ in b[1]]:
        return False
    for k, ts in a[0].items():
        us = b[0][k]
        if len(ts) != len(us) or any((t.data_ptr(), t.shape, t.dtype) != (u.data_ptr(), u.shape, u.dtype)
                                     for t, u in zip(ts, us, strict=True)):
            return False
    try:
        return all(_equal(x, y) for (_, x), (_, y) in zip(a[1], b[1], strict=True))
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and \
            x.dtype == y.dtype and bool(torch.equal(x, y))
    return type(x) is type(y) and bool(x == y)


def restore_rest(state: Any, rest: dict[str, Any], payload: memoryview, header: Header, live: set[int],
                 allow_pickle: bool) -> None:
    """Put the ``rest`` section of the record ``header`` (tensors in ``payload``) back into ``state``: the same
    keys, shapes and dtypes as captured, else StateMismatchError naming the key (the state changed shape)."""
    path = header.path
    flat = flatten(state, template=True)
    tensors, values = rest.get("tensors"), rest.get("values")
    if not isinstance(tensors, dict) or not isinstance(values, dict):
        raise StateMismatchError(f"{path}: the step record's rest of the state is malformed")
    with torch.no_grad():
        for leaf in flat.tensors:
            entries = tensors.get(leaf.key)
            parts = [t for _, t in leaf.parts]
            if entries is None:
                if all(t.numel() == 0 or t.data_ptr() in live for t in parts):
                    continue
                raise StateMismatchError(f"{path}: the step record lacks key {leaf.key!r} of the live state")
            if not isinstance(entries, list) or len(entries) != len(parts):
                raise StateMismatchError(f"{path}: key {leaf.key!r} has {len(parts)} local parts, the record other")
            got = [tensor_at(e, payload, path, header.algo) for e in entries]
            for t, part in zip(got, parts, strict=True):
                if t.shape != part.shape or t.dtype != part.dtype:
                    raise StateMismatchError(f"{path}: key {leaf.key!r} is {t.dtype} {list(t.shape)} in the step "
                                             f"record, {part.dtype} {list(part.shape)} in the live state")
            if leaf.kind == "tensor":
                for t, part in zip(got, parts, strict=True):
                    part.copy_(t)
            else:
                _assign(flat, leaf.path, as_leaf(leaf.kind, got[0]))
        for key, path_parts, _ in flat.values:
            if key in values:
                _assign(flat, path_parts, decode_value(values[key], key, allow_pickle))
    for _, adapter, sd in reversed(flat.statefuls):
        adapter.load_state_dict(sd)


__all__ = ["RestCapture", "capture_rest", "restore_rest"]
