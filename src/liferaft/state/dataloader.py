"""torchdata's ``StatefulDataLoader`` in a state: each rank's position, back on the same rank.

Put the loader itself in the state (``{"loader": loader, ...}``); liferaft picks this adapter for it (no import of
torchdata unless the state holds one). Its state dict (sampler position, the shuffling generator's state, worker
snapshots) is saved with the data-parallel world size it belongs to (the size of the process group the save
runs over: a save per replica with ``process_group=`` a subgroup records the subgroup's size); the parts that differ between ranks — the
generator of a loader shuffled per rank, the sampler of a ``DistributedSampler`` — are stored per rank, the
others once (``planning.save_plan``).

- Same world size: every rank gets its own state back and yields exactly the batches an uninterrupted run would.
- Another world size: a loader's position is a position in *this rank's* share of the data, which another number
  of ranks cuts differently, so it cannot be carried over honestly — the load is refused before anything is
  changed (``StateMismatchError``, naming the loader), with one exception: a loader whose batch sampler is a
  ``liferaft.data.GlobalSampler`` (its position is global and the same on every rank) continues the same global
  sample order on any number of ranks.

PyTorch DCP stores one rank's copy of such a state for every rank (it deduplicates by key).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from liferaft.errors import StateMismatchError

#: the key, next to the loader's own, that records the world size the state was saved on
WORLD = "liferaft_world_size"


def is_stateful_dataloader(obj: Any) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (without importing torchdata)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(module, "StatefulDataLoader", None) if module is not None else None
    return cls is not None and isinstance(obj, cls)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass
class DataLoaderAdapter:
    loader: Any
    #: the size of the process group the save / load runs over (None: the default group's); a save over a
    #: subgroup (one per data-parallel replica) records the subgroup's size, not the job's
    world: int | None = None
    #: checkpoints written before liferaft recorded the world size lack it (state.matching)
    optional: tuple[tuple[str, ...], ...] = ((WORLD,),)

    @property
    def resize_hint(self) -> str:
        return ("It is part of a torchdata StatefulDataLoader, whose position is per rank: resume with the number "
                "of ranks that saved it; to change the data-parallel size, give the loader a "
                "liferaft.data.GlobalSampler as batch_sampler (a global position that reshards), or leave the loader "
                "out of the state (it starts its epoch afresh)")

    def reshardable(self) -> bool:
        from liferaft.data.sampler import GlobalSampler

        return isinstance(getattr(self.loader, "batch_sampler", None), GlobalSampler) or \
            isinstance(getattr(self.loader, "sampler", None), GlobalSampler)

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.loader.state_dict())
        sd[WORLD] = self.world if self.world is not None else _world()
        return sd

    def check_load(self, values: Mapping[tuple[Any, ...], Any], world: int, where: str) -> None:
        """Before anything is loaded: refuse a state saved on another world size (see the module doc)."""
        saved = values.get((WORLD,))
        if isinstance(saved, int) and saved != world and not self.reshardable():
            raise StateMismatchError(
                f"{where}: the StatefulDataLoader state was saved by {saved} rank(s) and is loaded on {world}; "
                f"nothing was loaded. {self.resize_hint}")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        sd = dict(sd)
        saved = sd.pop(WORLD, None)
        if isinstance(saved, int):          # (also on the load paths that have no check_load: DCP sources)
            self.check_load({(WORLD,): saved}, self.world if self.world is not None else _world(),
                            "StatefulDataLoader")
        self.loader.load_state_dict(sd)
