"""Adapters between stateful objects and the plain nested state that liferaft stores.

The contract (one small interface): an adapter returns a nested dict of tensors and plain values from
``state_dict()`` and accepts the same structure, filled with loaded values, in ``load_state_dict(sd)``.

- ``nn.Module`` → torch's ``get_model_state_dict`` (canonical parameter names: DDP/compile prefixes removed;
  FSDP2/DTensor parameters stay sharded, nothing is gathered);
- ``Optimizer`` over the parameters of a module in the same state → torch's ``get_optimizer_state_dict``,
  keyed by parameter name, so it reshards like the parameters;
- torchdata's ``StatefulDataLoader`` → its state dict with the world size it belongs to (``state.dataloader``:
  per rank, refused on another world size unless its sampler is a ``liferaft.data.GlobalSampler``);
- any other object with ``state_dict()`` / ``load_state_dict()`` (LR schedulers, an Optimizer without a
  module, user objects) → those two methods.

Adapters may say more about what a load may find (``liferaft.state.matching`` applies it, on every load path):
``load_template()`` (the structure a load fills, when it differs from what a save stores), ``optional`` (subtrees
of that template a checkpoint may lack as a whole) and ``not_persisted()`` (keys a checkpoint may hold that the
object does not load).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from liferaft.state.dataloader import DataLoaderAdapter, is_stateful_dataloader


class Adapter(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


#: the types whose tensors are replicated by the parallelism's own contract (DDP keeps parameters, buffers and
#: optimizer state equal on every rank); a save does not compare their plain tensors across ranks (that would
#: cost a pass over the whole model), unlike every other plain tensor (``state.flatten``)
def replicated_by_contract(obj: Any) -> bool:
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


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

    def not_persisted(self) -> tuple[str, ...]:
        """The names, as the state dict spells them (wrapper prefixes such as DDP's ``module.`` or
        ``torch.compile``'s ``_orig_mod.`` removed, like ``get_model_state_dict`` does), of the buffers registered
        with ``persistent=False``: a checkpoint may hold them (Hugging Face files hold BERT's
        ``embeddings.position_ids``), but the module does not load them."""
        from torch.distributed.checkpoint.state_dict import _get_fqns

        out: list[str] = []
        for prefix, mod in self.module.named_modules():
            for name in sorted(getattr(mod, "_non_persistent_buffers_set", ())):
                full = f"{prefix}.{name}" if prefix else name
                try:
                    out.extend(sorted(_get_fqns(self.module, full)))
                except Exception:  # noqa: BLE001 - a wrapper torch does not know: keep the raw name
                    out.append(full)
        return tuple(out)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, sd, options=StateDictOptions(strict=True))


@dataclass
class OptimizerAdapter:
    """An optimizer keyed by the parameter names of ``module``.

    A parameter the optimizer never stepped (no gradient yet, or never: a pooler the loss does not use) has no
    state in it. torch's ``get_optimizer_state_dict`` gives an optimizer that never stepped at all placeholder
    state for every parameter (a step with zero gradients and lr 0) and leaves it there; this adapter takes it
    away again, so that neither a save nor a load template changes the optimizer: a save stores only the state
    the optimizer had, and a load template lists the placeholders as ``optional`` — a checkpoint that lacks all
    of a parameter's state is consistent with them, and the optimizer then stays without state for it, as the
    saving run had it (a part of it, say ``exp_avg`` without ``exp_avg_sq``, is still a mismatch).
    """

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: subtrees (``("state", name)``) of the last load template that only hold placeholders
    optional: tuple[tuple[str, ...], ...] = ()

    def _state_dict(self) -> tuple[dict[str, Any], bool]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        sd = get_optimizer_state_dict(self.module, self.optimizer)
        placeholders = fresh and bool(self.optimizer.state)
        if placeholders:
            self.optimizer.state.clear()       # undo torch's initialisation (the state dict keeps the tensors)
        return sd, placeholders

    def state_dict(self) -> dict[str, Any]:
        sd, placeholders = self._state_dict()
        if placeholders:
            sd = {**sd, "state": {}}
        return sd

    def load_template(self) -> dict[str, Any]:
        sd, placeholders = self._state_dict()
        self.optional = tuple(("state", name) for name in sd.get("state", {})) if placeholders else ()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # liferaft checked the keys already; torch's strict check would refuse a parameter without state
        set_optimizer_state_dict(self.module, self.optimizer, sd, options=StateDictOptions(strict=False))


def make_adapters(objects: list[Any], world: int | None = None) -> dict[int, Adapter]:
    """Adapters for the stateful objects of one state, keyed by ``id(obj)``.

    Optimizers are paired with the module in the same state that owns all their parameters. ``world``: the size
    of the process group the save / load runs over (None: the default group's), for the adapters recording it.
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
        elif is_stateful_dataloader(obj):
            out[id(obj)] = DataLoaderAdapter(obj, world)
        else:
            out[id(obj)] = MethodAdapter(obj)
    return out
