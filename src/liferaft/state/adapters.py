"""Adapters between stateful objects and the plain nested state that liferaft stores.

The contract (one small interface): an adapter returns a nested dict of tensors and plain values from
``state_dict()`` and accepts the same structure, filled with loaded values, in ``load_state_dict(sd)``.

- ``nn.Module`` → torch's ``get_model_state_dict`` (canonical parameter names: DDP/compile prefixes removed;
  FSDP2/DTensor parameters stay sharded, nothing is gathered);
- ``Optimizer`` over the parameters of a module in the same state → torch's ``get_optimizer_state_dict``,
  keyed by parameter name, so it reshards like the parameters;
- any other object with ``state_dict()`` / ``load_state_dict()`` (LR schedulers, an Optimizer without a
  module, user objects) → those two methods.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Adapter(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) \
        and not isinstance(obj, type)


@dataclass
class MethodAdapter:
    obj: Any

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.obj.load_state_dict(sd)


@dataclass
class ModuleAdapter:
    module: torch.nn.Module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, sd, options=StateDictOptions(strict=True))


@dataclass
class OptimizerAdapter:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, sd)


def make_adapters(objects: list[Any]) -> dict[int, Adapter]:
    """Adapters for the stateful objects of one state, keyed by ``id(obj)``.

    Optimizers are paired with the module in the same state that owns all their parameters.
    """
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    owned = [(m, {id(p) for p in m.parameters()}) for m in modules]
    out: dict[int, Adapter] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            out[id(obj)] = ModuleAdapter(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            params = {id(p) for g in obj.param_groups for p in g["params"]}
            owner = next((m for m, ids in owned if params <= ids), None)
            if owner is not None:
                out[id(obj)] = OptimizerAdapter(owner, obj)
            else:
                warnings.warn(
                    f"{type(obj).__qualname__}: no nn.Module in the same state owns all its parameters, so its "
                    "state is saved by parameter index and can only be loaded into the same parameter order; put "
                    "the model in the same state (e.g. {'model': m, 'optim': opt}) to key it by parameter name",
                    stacklevel=4)
                out[id(obj)] = MethodAdapter(obj)
        else:
            out[id(obj)] = MethodAdapter(obj)
    return out
