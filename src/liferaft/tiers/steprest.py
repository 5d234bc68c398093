"""The rest of the state in a step record: everything a replay of the optimizer steps does not rebuild.

Parameters and the optimizer-state tensors of the tracked optimizers are rebuilt by replaying the recorded steps;
everything else in the state (model buffers, the data position, RNG streams, schedulers, a GradScaler, the
optimizers' hyperparameters and step counters outside tensors, user values) is small and recorded in full after
every step. Captured through ``state.flatten`` (the same walk a save makes) and put back the way a load does:
tensors copied into the live ones, plain values assigned, then every stateful object's ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from liferaft.core.load import _assign
from liferaft.errors import StateMismatchError
from liferaft.state.flatten import flatten
from liferaft.state.values import as_leaf, decode_value, encode_value
from liferaft.tiers.steprecord import Header, tensor_at


def capture_rest(state: Any, live: set[int], put: Callable[[torch.Tensor], dict[str, Any]],
                 allow_pickle: bool) -> dict[str, Any]:
    """The ``rest`` section of a record: tensors not in ``live`` (``data_ptr`` of parameters and optimizer-state
    tensors) stored by ``put`` (one entry per local part), and plain values encoded."""
    flat = flatten(state)
    tensors: dict[str, list[dict[str, Any]]] = {}
    for leaf in flat.tensors:
        parts = [t for _, t in leaf.parts]
        if all(t.numel() == 0 or t.data_ptr() in live for t in parts):
            continue
        tensors[leaf.key] = [put(t.detach()) for t in parts]
    values = {key: encode_value(v, key, allow_pickle) for key, _, v in flat.values}
    return {"tensors": tensors, "values": values}


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


__all__ = ["capture_rest", "restore_rest"]
