"""liferaft as torchtitan's checkpoint manager: ``LiferaftCheckpointManager``, chosen in the job's config.

Importing this module imports ``torchtitan`` (0.3); ``import liferaft`` never does.

torchtitan builds its checkpointer from the job's config (``config.checkpoint.build(dataloader=, model_parts=,
optimizers=, lr_schedulers=, states=, sd_adapter=, base_folder=)``) and drives it through
``BaseCheckpointManager``'s contract: ``load(step)`` before training, ``maybe_wait_for_staging()`` before each
optimizer step, ``save(step, last_step)`` after it, ``close()`` at the end. This manager implements that contract
with liferaft, so the one change is the config's checkpoint section::

    config.checkpoint = LiferaftCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                         async_save=True)

What is saved, every ``interval`` steps into ``<dump_folder>/<folder>/step-<n>/`` (a liferaft checkpoint,
committed atomically): the model parts (their FQN state dicts, FSDP2 / TP DTensor shards as they are, nothing
gathered), the ``OptimizersContainer`` (its flat, FQN-keyed state: it reshards like the parameters), the
``LRSchedulersContainer``, the data loader's position (torchdata's ``StatefulDataLoader`` state of each rank,
stored per rank as plain values — not torchtitan's pickled bytes, so a load runs nothing from the checkpoint) and
every other entry of ``states`` (the trainer's step and token count). ``async_save=True`` returns once the
snapshot is taken into liferaft's reused staging buffers; writing and the commit run behind (the next save and
``close`` wait for it). ``keep_latest_k`` removes older committed steps (on rank 0, in the background).

``load(step=-1)`` restores the newest committed step (a step killed midway is never picked), on any number of
ranks and any layout liferaft reshards between (FSDP2 on 2 ranks → 3, FSDP2 ↔ TP), every byte verified. The data
loader's position belongs to its data-parallel size: on another size the load is refused before anything changes,
unless ``exclude_from_loading=["dataloader"]`` (as torchtitan's own manager, which refuses too). Step 0 (the seed
checkpoint) and ``initial_load_path`` load the model alone (``initial_load_model_only``); ``initial_load_path``
may be a liferaft checkpoint or a PyTorch DCP folder (torchtitan's own steps). A final ``last_step`` save with
``last_save_model_only`` writes the model alone, cast to ``export_dtype``. Not supported (refused by the config):
the Hugging Face safetensors paths (``initial_load_in_hf``, ``last_save_in_hf``: use ``liferaft convert --to hf``),
and resuming from torchtitan's own DCP ``step-<n>`` folders in ``folder`` (their data-loader state is pickled:
load them once with ``initial_load_path`` and ``initial_load_model_only=False``, without the data position).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from liferaft.core.load import load
from liferaft.core.open import format_of
from liferaft.core.read import inspect
from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.errors import CheckpointNotFoundError, OptionsError, StateMismatchError
from liferaft.integrations._common import committed
from liferaft.options import LoadOptions, SaveOptions

__all__ = ["LiferaftCheckpointManager"]

_STEP = re.compile(r"^step-(0|[1-9]\d*)$")          # (the names torchtitan makes: "step-01" is none of them)
#: a step saved again (a job resumed from an earlier step with ``load_step``) replaces it at its commit, as
#: torchtitan's own manager does; until then the previous one stays loadable
_OVERWRITE = SaveOptions(overwrite=True)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class LiferaftCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, through liferaft (the module's docstring says what and how)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_save: bool = False
        """Return from a save once the snapshot is taken; write and commit in the background."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.initial_load_in_hf or self.initial_load_in_hf_quantized or self.last_save_in_hf:
                raise OptionsError("LiferaftCheckpointManager: the Hugging Face safetensors paths "
                                   "(initial_load_in_hf, last_save_in_hf) are not supported; export with "
                                   "`liferaft convert <step> <out> --to hf`")
            if "://" in self.folder:
                raise OptionsError("LiferaftCheckpointManager: checkpoint.folder must be a local or shared file "
                                   f"system path, got {self.folder!r}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None, base_folder: str = "") -> None:
        self.save_future: AsyncSaveHandle | None = None
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        entries: dict[str, Any] = {k: _Methods(v) for k, v in states.items()}
        entries.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: _Methods(optimizers),
                        LR_SCHEDULER: _Methods(lr_schedulers)})
        if dataloader is not None:
            entries[DATALOADER] = _Loader(dataloader)
        self.states = entries
        self._purges: list[threading.Thread] = []

    # -- saving --------------------------------------------------------------------------------------------------

    def _should_save(self, step: int, last_step: bool) -> bool:
        c = self.config
        if c.load_only:
            return False
        return (step == 1 and c.enable_first_step_checkpoint) or last_step or step % c.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        path = self._step_path(curr_step)
        if last_step and self.config.last_save_model_only:
            dtype = _DTYPES[self.config.export_dtype]
            model = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in self.states[MODEL].state_dict().items()}
            save(path, {MODEL: model}, options=_OVERWRITE)
        elif self.config.async_save and not last_step:
            self.save_future = async_save(path, self.states, options=_OVERWRITE)
        else:
            save(path, self.states, options=_OVERWRITE)
        if not last_step:                   # (as torchtitan's own manager: the final save purges nothing)
            self._purge(keep=curr_step)
        return True

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        if handle is not None:
            handle.wait()

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``async_save`` returns once the snapshot is taken (the tensors copied into
        liferaft's staging buffers), so the optimizer step that follows may change them."""

    def _purge(self, keep: int) -> None:
        """Rank 0 removes the committed steps older than the newest ``keep_latest_k`` (the save in flight counts as
        one of them), in the background."""
        k = self.config.keep_latest_k
        if k <= 0 or _rank() != 0:
            return
        steps = sorted({*self._committed_steps(), keep})
        old = [s for s in steps[:-k] if s != keep]
        if old:
            t = threading.Thread(target=_remove, args=[self._step_path(s) for s in old], daemon=True,
                                 name="liferaft-torchtitan-purge")
            t.start()
            self._purges.append(t)

    def _close(self) -> None:
        self.maybe_wait_for_saving()
        for t in self._purges:
            t.join()
        self._purges.clear()

    # -- loading -------------------------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        c = self.config
        if step != -1:
            if not os.path.isdir(self._step_path(step)):
                raise CheckpointNotFoundError(f"checkpoint.load_step={step}: no {self._step_path(step)}")
            found = step
        else:
            steps = self._committed_steps()
            found = max(steps) if steps else -1
            foreign = [n for n in self._foreign_steps() if n > found]
            if foreign:
                raise OptionsError(
                    f"{self.folder} holds PyTorch DCP steps newer than its newest liferaft step "
                    f"({', '.join(f'step-{n}' for n in sorted(foreign))}; newest liferaft: "
                    f"{'step-' + str(found) if found >= 0 else 'none'}): torchtitan's own manager wrote them, and "
                    "liferaft does not resume their pickled data-loader state. Move them out of the folder and "
                    "start from the newest one with checkpoint.initial_load_path (its model), or resume with "
                    "torchtitan's own manager")
        if found == -1:
            if not c.initial_load_path:
                return False
            self._load_from(c.initial_load_path, model_only=c.initial_load_model_only)
            return True
        self._load_from(self._step_path(found), model_only=found == 0)
        return True

    def _load_from(self, path: str, *, model_only: bool) -> None:
        if model_only:
            model = self.states[MODEL]
            dcp = format_of(path) == "dcp"                  # torchtitan's own steps: model keys at the top
            own = model.state_dict()                        # (views of the live parameters)
            info = inspect(path)                            # keys checked before a byte is read into them
            stored = {t.key for t in info.tensors} | set(info.values)
            missing = [k for k in own if (k if dcp else f"{MODEL}.{k}") not in stored]
            if missing:
                raise StateMismatchError(f"{path}: the model's keys {missing[:10]} are not in the checkpoint "
                                         f"({len(missing)} missing; nothing was loaded)")
            sd = own if dcp else {MODEL: own}
            load(path, sd, strict=False)                    # (the rest of a full step is not read)
            model.load_state_dict(sd if dcp else sd[MODEL])
            return
        if format_of(path) == "dcp":
            raise OptionsError(f"{path} is a PyTorch DCP checkpoint: liferaft loads its model (initial_load_path "
                               "with initial_load_model_only=True); its data-loader state is pickled and is not "
                               "loaded")
        excluded = tuple(_excluded(self.config, self.states))
        state = {k: v for k, v in self.states.items() if k not in excluded}
        options = LoadOptions(ignore_keys=excluded)       # strict for the rest: a missing key is refused
        if DATALOADER in state:                             # its position belongs to its data-parallel size
            saved = _Fields({"dp_world_size": 0})
            load(path, {DATALOADER: saved}, strict=False)       # (plain values only: nothing live)
            here = state[DATALOADER].dp_world_size
            if saved.values["dp_world_size"] != here:
                raise StateMismatchError(
                    f"{path}: the data loader's position was saved with a data-parallel size of "
                    f"{saved.values['dp_world_size']} and this job's is {here}; another size cuts the data "
                    f"differently. Nothing was loaded. Set checkpoint.exclude_from_loading=['dataloader'] to "
                    f"resume without it")
        load(path, state, options=options)

    # -- folders -------------------------------------------------------------------------------------------------

    def _step_path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _foreign_steps(self) -> list[int]:
        """The steps in ``folder`` that are PyTorch DCP checkpoints (torchtitan's own manager's)."""
        return [n for n, path in self._steps()
                if os.path.isfile(os.path.join(path, ".metadata")) and not committed(path)]

    def _committed_steps(self) -> list[int]:
        """The steps in ``folder`` with a committed liferaft checkpoint."""
        return [n for n, path in self._steps() if committed(path)]

    def _steps(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the ``step-<n>`` folders in ``folder`` (links not followed: not counted)."""
        out: list[tuple[int, str]] = []
        try:
            with os.scandir(self.folder) as entries:
                for e in entries:
                    m = _STEP.match(e.name)
                    if m and e.is_dir(follow_symlinks=False):
                        out.append((int(m.group(1)), e.path))
        except FileNotFoundError:
            pass
        return out

def _excluded(config: Any, states: dict[str, Any]) -> list[str]:
    """``exclude_from_loading``, checked: every key must be one of the saved states (as torchtitan's manager)."""
    for key in config.exclude_from_loading:
        if key not in states:
            raise OptionsError(f"checkpoint.exclude_from_loading: {key!r} is not one of {sorted(states)}")
    return list(config.exclude_from_loading)


class _Methods:
    """A stateful object as its two methods alone (an ``OptimizersContainer`` is an ``Optimizer``: liferaft would
    otherwise look for a module to key it by; it keys itself by FQN)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.obj.load_state_dict(sd)


class _Fields:
    """Some fields of a saved stateful object, read alone (a load with ``strict=False``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.values = dict(sd)


class _Loader:
    """A torchtitan data loader's position as plain values: torchdata's own ``StatefulDataLoader`` state (not the
    pickled bytes torchtitan's ``state_dict`` wraps it in) with the data-parallel size it belongs to. It differs
    per rank, so liferaft stores it per rank."""

    def __init__(self, loader: Any) -> None:
        if not isinstance(loader, StatefulDataLoader):
            raise OptionsError(f"LiferaftCheckpointManager: the dataloader must be a torchdata StatefulDataLoader "
                               f"(torchtitan's ParallelAwareDataloader), got {type(loader).__name__}")
        self.loader = loader
        self.dp_world_size = int(getattr(loader, "dp_world_size", 1))
        self.dp_rank = int(getattr(loader, "dp_rank", 0))

    def state_dict(self) -> dict[str, Any]:
        return {"dp_world_size": self.dp_world_size, "dp_rank": self.dp_rank,
                "state": StatefulDataLoader.state_dict(self.loader)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        StatefulDataLoader.load_state_dict(self.loader, sd["state"])


def _remove(*paths: str) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
