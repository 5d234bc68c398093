"""liferaft as the Hugging Face ``Trainer``'s checkpoint engine: ``trainer.add_callback(LiferaftCallback(trainer))``
with ``TrainingArguments(save_only_model=True, ...)``.

Importing this module imports ``transformers`` (``pip install liferaft[hf]``); ``import liferaft`` never does.

The Trainer offers no checkpoint-I/O seam: it writes its checkpoints (``<output_dir>/checkpoint-<step>/``) with
``torch.save`` and safetensors inside its own methods. What it does offer is ``save_only_model=True``, under which
it writes only the model (``model.safetensors``, the folder ``from_pretrained`` loads) and its progress
(``trainer_state.json``), and callbacks, which it calls on every process right after each checkpoint and at the
start of training. This callback uses both: at each of the Trainer's saves it saves the training state the Trainer
no longer writes — the optimizer (keyed by parameter name, through the model, so that it reshards), the
learning-rate scheduler, the gradient scaler (fp16), every rank's random streams (``liferaft.RNGState``), and the
model too (the liferaft checkpoint is complete on its own: ``liferaft inspect``, ``convert``, a load into another
layout) — as one liferaft checkpoint in ``checkpoint-<step>/liferaft/``, collectively over the Trainer's processes:
replicated tensors written once, the writes spread over the ranks, in the background with ``async_save=True``.
``save_total_limit`` removes it with its folder.

When training starts from a checkpoint (``trainer.train(resume_from_checkpoint=...)``: the Trainer has loaded the
model and its progress), the callback loads the liferaft part of the same checkpoint into the model, the optimizer,
the scheduler and the scaler — on any number of processes: a DDP run saved by 2 resumes on 1 or 3 — and gives each
rank back its random streams at the point the Trainer itself would (before the epoch's data loader is made when
the checkpoint ends an epoch, else before the first forward), so that a resume on the same number of processes
continues bit for bit. Before any of it, it checks that the part belongs to the checkpoint the Trainer resumed
from (same step, same log history: the Trainer's ``resume_from_checkpoint=True`` takes the newest
``checkpoint-<n>`` folder, with or without a committed liferaft part). ``last_checkpoint(output_dir)`` is the
newest checkpoint whose liferaft part is committed: pass it as ``resume_from_checkpoint``.

Not covered: DeepSpeed (it saves its own engine state; refused), hyperparameter search (its run folders), and the
Trainer's own ``optimizer.pt`` files (``save_only_model=False`` is refused rather than saving twice: to resume a run
that predates the switch, resume it once without the callback). The data position is the Trainer's (its global
step, then ``skip_first_batches``). Tested with DDP (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from liferaft.core.commit import read_commit
from liferaft.core.load import load
from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.errors import LiferaftError, OptionsError, StateMismatchError
from liferaft.options import LoadOptions, SaveOptions
from liferaft.state.rng import RNGState
from liferaft.storage import resolve

__all__ = ["PART", "LiferaftCallback", "last_checkpoint"]

#: The name of the liferaft checkpoint inside each of the Trainer's ``checkpoint-<step>/`` folders.
PART = "liferaft"

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-<step>`` folder in ``output_dir`` that holds the Trainer's progress and a committed
    liferaft part (a save killed midway leaves neither counted), or None: what to pass as
    ``trainer.train(resume_from_checkpoint=...)``. Links are not followed."""
    root = os.fspath(output_dir)
    found: list[tuple[int, str]] = []
    try:
        with os.scandir(root) as entries:
            for e in entries:
                m = _CHECKPOINT.match(e.name)
                if m and e.is_dir(follow_symlinks=False):
                    found.append((int(m.group(1)), e.path))
    except FileNotFoundError:
        return None
    for _, path in sorted(found, reverse=True):
        if os.path.isfile(os.path.join(path, "trainer_state.json")) and _committed(os.path.join(path, PART)):
            return path
    return None


def _committed(path: str) -> bool:
    try:
        read_commit(resolve(path))
    except (LiferaftError, OSError):
        return False
    return True


class LiferaftCallback(TrainerCallback):
    """Saves and restores the ``trainer``'s training state through liferaft (the module's docstring says what and
    when). ``trainer`` must have been made with ``TrainingArguments(save_only_model=True)``. ``async_save``: a save
    returns once the snapshot is taken and is committed in the background (the next save, the end of training and
    the interpreter's exit wait for it). ``options`` are the saves' ``SaveOptions`` (``overwrite`` is always on:
    the Trainer may save the same step twice); ``load_options`` the loads'. ``resume_from``: the checkpoint folder
    the Trainer resumes from when it is not one of ``output_dir``'s (the callback is not told which one the
    Trainer was given; it takes ``<output_dir>/checkpoint-<step>`` by default and checks that it is the one)."""

    def __init__(self, trainer: Trainer, *, async_save: bool = False, options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None, resume_from: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(trainer, Trainer):
            raise OptionsError(f"LiferaftCallback(trainer) needs a transformers.Trainer, got {type(trainer).__name__}")
        if not isinstance(async_save, bool):
            raise OptionsError(f"LiferaftCallback(async_save=...) must be True or False, got {async_save!r}")
        for name, value, kind in (("options", options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, kind):
                raise OptionsError(f"LiferaftCallback({name}=...) must be a {kind.__name__}, got "
                                   f"{type(value).__name__}")
        if not trainer.args.save_only_model:
            raise OptionsError("LiferaftCallback needs TrainingArguments(save_only_model=True): the optimizer, the "
                               "scheduler and the random streams are saved by liferaft, and the Trainer would "
                               "otherwise save them again with torch.save (and load those instead)")
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise OptionsError("LiferaftCallback does not support DeepSpeed: its engine saves and loads its own "
                               "state; use the Trainer's own checkpoints")
        self.trainer = trainer
        self.async_save = async_save
        self.options = SaveOptions(**{**(options or SaveOptions()).__dict__, "overwrite": True})
        self.load_options = load_options
        self.resume_from = None if resume_from is None else os.fspath(resume_from)
        self._pending: AsyncSaveHandle | None = None
        self._rng: _DeferredRNG | None = None       # loaded, to be given back at the Trainer's own point
        self._rng_at_epoch = False

    # -- the state -----------------------------------------------------------------------------------------------

    def _state(self, progress: dict[str, Any], rng: Any) -> dict[str, Any]:
        t = self.trainer
        if t.optimizer is None or t.lr_scheduler is None:
            raise OptionsError("LiferaftCallback: the Trainer has no optimizer or scheduler yet (it makes them when "
                               "training starts)")
        state: dict[str, Any] = {
            "model": t.accelerator.unwrap_model(t.model_wrapped),
            "optimizer": getattr(t.optimizer, "optimizer", t.optimizer),      # (Accelerate's wrapper)
            "scheduler": getattr(t.lr_scheduler, "scheduler", t.lr_scheduler),
            "rng": rng,
            "trainer": progress,
        }
        if t.accelerator.scaler is not None:
            state["scaler"] = t.accelerator.scaler
        return state

    # -- saving --------------------------------------------------------------------------------------------------

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Called on every process right after the Trainer wrote ``checkpoint-<step>``: save its liferaft part."""
        self.wait()
        path = os.path.join(self._folder(args, state), PART)
        full = self._state(_progress(state), RNGState())
        if self.async_save:
            self._pending = async_save(path, full, options=self.options)
        else:
            save(path, full, options=self.options)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if control.should_save:         # before the Trainer's next save rotates old folders away
            self.wait()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_save:
            self.wait()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.wait()

    def wait(self) -> None:
        """Wait for the save in flight (``async_save=True``) to commit; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    # -- resuming ------------------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """The Trainer resumes when its restored progress is past step 0: load the liferaft part of that
        checkpoint, after checking that it is that checkpoint's."""
        self._rng = None
        if state.global_step <= 0:
            return
        folder = self.resume_from or self._folder(args, state)
        path = os.path.join(folder, PART)
        if not _committed(path):
            newest = last_checkpoint(args.output_dir)
            raise StateMismatchError(
                f"the Trainer resumes from step {state.global_step} but {path} holds no committed liferaft "
                f"checkpoint (a save killed midway, or a checkpoint written without LiferaftCallback); resume "
                f"from last_checkpoint(output_dir) instead ({newest or 'none in ' + os.fspath(args.output_dir)})"
                + ("" if self.resume_from else ", or pass LiferaftCallback(resume_from=...) when the checkpoint "
                   "is not in output_dir"))
        saved: dict[str, Any] = {"trainer": {"global_step": 0, "log_history": ""}}
        load(path, saved, strict=False, options=self.load_options)     # the progress alone, nothing live yet
        expected = _progress(state)
        if saved["trainer"] != expected:
            raise StateMismatchError(
                f"{path} was saved at {saved['trainer']} but the Trainer resumed at {expected}: it is not the "
                f"checkpoint the Trainer resumed from; pass the folder given to resume_from_checkpoint as "
                f"LiferaftCallback(resume_from=...)")
        rng = _DeferredRNG()
        load(path, self._state(expected, rng), options=self.load_options)
        self._rng = rng
        self._rng_at_epoch = float(state.epoch or 0.0).is_integer()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._rng is not None and self._rng_at_epoch:    # a checkpoint at the end of an epoch: before the
            self._give_back_rng()                              # next epoch's loader draws its seed

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._rng is not None:       # mid-epoch: after the skipped batches and the first fetch, before forward
            self._give_back_rng()

    def _give_back_rng(self) -> None:
        rng, self._rng = self._rng, None
        assert rng is not None
        rng.apply()

    def _folder(self, args: TrainingArguments, state: TrainerState) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _progress(state: TrainerState) -> dict[str, Any]:
    """What ties a liferaft part to the Trainer's checkpoint: the step and a digest of the log history (the
    Trainer writes both into ``trainer_state.json`` just before the callback saves, and reads them back when it
    resumes)."""
    log = json.dumps(state.log_history, sort_keys=True).encode()
    return {"global_step": int(state.global_step), "log_history": hashlib.sha256(log).hexdigest()}


class _DeferredRNG:
    """``RNGState`` whose load keeps the saved streams until ``apply()`` gives them back."""

    accepts_per_rank = True

    def __init__(self) -> None:
        self._saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return RNGState().state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._saved = sd

    def apply(self) -> None:
        if self._saved is not None:
            RNGState().load_state_dict(self._saved)
