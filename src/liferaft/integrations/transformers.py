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
The Trainer's ``save_total_limit`` must be off: the Trainer removes old checkpoints before the callback has saved
the new one, so a process killed in between would leave nothing to resume from. ``keep_last=N`` does the same job
safely: older folders go only once a newer part has committed (the Trainer's best one is kept).

When training starts from a checkpoint (``trainer.train(resume_from_checkpoint=...)``: the Trainer has loaded the
model and its progress), the callback loads the liferaft part of the same checkpoint into the model, the optimizer,
the scheduler and the scaler — on any number of processes: a DDP run saved by 2 resumes on 1 or 3 — and gives each
rank back its random streams at the point the Trainer itself would (before the epoch's data loader is made when
the checkpoint ends an epoch, else before the first forward), so that a resume on the same number of processes
continues bit for bit. Before any of it, it checks that the part belongs to the checkpoint the Trainer resumed
from: each save writes a fresh random token both into ``trainer_state.json`` (through ``LiferaftSaveToken``, a
stateful callback the Trainer asks while it writes that file) and into the part, with the step. Another run's
part, or a step saved again and killed before its part committed, is refused; so is a part never committed (the
Trainer's ``resume_from_checkpoint=True`` takes the newest ``checkpoint-<n>`` folder whatever it holds).
``last_checkpoint(output_dir)`` is the newest checkpoint that passes these checks: pass it as
``resume_from_checkpoint``.

Not covered: DeepSpeed (it saves its own engine state; refused), hyperparameter search (its run folders), and the
Trainer's own ``optimizer.pt`` files (``save_only_model=False`` is refused rather than saving twice: to resume a run
that predates the switch, resume it once without the callback). The data position is the Trainer's (its global
step, then ``skip_first_batches``). Tested with DDP (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from liferaft.core.load import load
from liferaft.core.read import read
from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.errors import LiferaftError, OptionsError, StateMismatchError
from liferaft.format.layout import COMMIT_MARKER
from liferaft.integrations._common import committed
from liferaft.options import LoadOptions, SaveOptions
from liferaft.state.rng import RNGState

__all__ = ["PART", "LiferaftCallback", "LiferaftSaveToken", "last_checkpoint"]

#: The name of the liferaft checkpoint inside each of the Trainer's ``checkpoint-<step>/`` folders.
PART = "liferaft"

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(0|[1-9]\d*)$")
_MAX_STATE_BYTES = 256 << 20             # trainer_state.json read by last_checkpoint (its log history grows)


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The ``checkpoint-<step>`` folder in ``output_dir`` whose liferaft part committed last, among those whose
    part belongs to the Trainer's files beside it (the save token in ``trainer_state.json`` is the part's: a save
    killed midway, or a step saved again and killed before its part committed, is not counted), or None: what to
    pass as ``trainer.train(resume_from_checkpoint=...)``. Committed last, not the highest step: after a run rolled
    back to an earlier checkpoint, the abandoned run's higher steps are not its newest state. Links are not
    followed."""
    found = [(at, step, path) for step, path in _folders(os.fspath(output_dir))
             if (at := committed_at(path, step)) is not None]
    return max(found)[2] if found else None


def _folders(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the ``checkpoint-<step>`` entries of ``root`` (links included; none if no folder)."""
    out: list[tuple[int, str]] = []
    try:
        with os.scandir(root) as entries:
            for e in entries:
                m = _CHECKPOINT.match(e.name)
                if m:
                    out.append((int(m.group(1)), e.path))
    except FileNotFoundError:
        pass
    return out


def committed_at(folder: str, step: int) -> int | None:
    """When the liferaft part of ``folder`` (``checkpoint-<step>``) committed (its marker's mtime, ns), if the
    folder is resumable: not a link, its part committed at ``step`` with the token of its ``trainer_state.json``;
    else None."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        return None
    token = _trainer_token(folder)
    if token is None or _part_progress(os.path.join(folder, PART)) != {"global_step": step, "token": token}:
        return None
    try:
        return os.stat(os.path.join(folder, PART, COMMIT_MARKER), follow_symlinks=False).st_mtime_ns
    except OSError:
        return None


def _trainer_token(folder: str) -> str | None:
    """The save token the Trainer wrote into ``folder/trainer_state.json`` (None: no such file, not a regular
    file, too large, not JSON, no token)."""
    path = os.path.join(folder, "trainer_state.json")
    try:
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > _MAX_STATE_BYTES:
            return None
        with open(path, "rb") as f:
            doc = json.loads(f.read(_MAX_STATE_BYTES + 1))
        entry = doc["stateful_callbacks"][LiferaftSaveToken.__name__]
        entry = entry[-1] if isinstance(entry, list) else entry
        token = entry["attributes"]["token"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    return token if isinstance(token, str) else None


def _part_progress(path: str) -> dict[str, Any] | None:
    """What the liferaft part at ``path`` was saved at (``{"global_step", "token"}``), or None when it is not a
    committed liferaft checkpoint holding it."""
    if not committed(path):
        return None
    try:
        got = read(path, keys=["trainer"])["trainer"]
    except (LiferaftError, OSError, KeyError, TypeError):
        return None
    return got if isinstance(got, dict) else None


class LiferaftCallback(TrainerCallback):
    """Saves and restores the ``trainer``'s training state through liferaft (the module's docstring says what and
    when). ``trainer`` must have been made with ``TrainingArguments(save_only_model=True)`` and without
    ``save_total_limit`` (the Trainer removes old checkpoints before the callback has saved the new one: use
    ``keep_last``). ``async_save``: a save returns once the snapshot is taken and is committed in the background
    (the next save, the end of training and the interpreter's exit wait for it). ``keep_last``: keep the newest
    ``keep_last`` checkpoints whose part is committed (and the Trainer's best one), removing older
    ``checkpoint-<step>`` folders once a newer part has committed (None: keep all). ``options`` are the saves'
    ``SaveOptions`` (``overwrite`` is always on: the Trainer may save the same step twice); ``load_options`` the
    loads'. ``resume_from``: the checkpoint folder the Trainer resumes from when it is not one of ``output_dir``'s
    (the callback is not told which one the Trainer was given; it takes ``<output_dir>/checkpoint-<step>`` by
    default and checks that it is the one)."""

    def __init__(self, trainer: Trainer, *, async_save: bool = False, keep_last: int | None = None,
                 options: SaveOptions | None = None, load_options: LoadOptions | None = None,
                 resume_from: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(trainer, Trainer):
            raise OptionsError(f"LiferaftCallback(trainer) needs a transformers.Trainer, got {type(trainer).__name__}")
        if not isinstance(async_save, bool):
            raise OptionsError(f"LiferaftCallback(async_save=...) must be True or False, got {async_save!r}")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise OptionsError(f"LiferaftCallback(keep_last=...) must be a positive integer or None, got "
                               f"{keep_last!r}")
        for name, value, kind in (("options", options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, kind):
                raise OptionsError(f"LiferaftCallback({name}=...) must be a {kind.__name__}, got "
                                   f"{type(value).__name__}")
        if not trainer.args.save_only_model:
            raise OptionsError("LiferaftCallback needs TrainingArguments(save_only_model=True): the optimizer, the "
                               "scheduler and the random streams are saved by liferaft, and the Trainer would "
                               "otherwise save them again with torch.save (and load those instead)")
        if trainer.args.save_total_limit is not None:
            raise OptionsError("LiferaftCallback needs TrainingArguments(save_total_limit=None): the Trainer removes "
                               "old checkpoints before the callback has saved the new one, so a process killed "
                               "then would leave none to resume from; pass LiferaftCallback(keep_last="
                               f"{trainer.args.save_total_limit}) instead")
        if trainer.args.save_on_each_node:
            raise OptionsError("LiferaftCallback does not support TrainingArguments(save_on_each_node=True): a "
                               "liferaft checkpoint is written by every process into one folder, so output_dir "
                               "must be on a file system all nodes share (or use an s3:// root with "
                               "liferaft.CheckpointManager)")
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise OptionsError("LiferaftCallback does not support DeepSpeed: its engine saves and loads its own "
                               "state; use the Trainer's own checkpoints")
        self.trainer = trainer
        self.async_save = async_save
        self.keep_last = keep_last
        self.options = SaveOptions(**{**(options or SaveOptions()).__dict__, "overwrite": True})
        self.load_options = load_options
        self.resume_from = None if resume_from is None else os.fspath(resume_from)
        self._pending: AsyncSaveHandle | None = None
        self._rng: _DeferredRNG | None = None       # loaded, to be given back at the Trainer's own point
        self._rng_at_epoch = False
        if not any(isinstance(cb, LiferaftSaveToken) for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(LiferaftSaveToken())

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
        """Called on every process right after the Trainer wrote ``checkpoint-<step>``: save its liferaft part,
        tied to the Trainer's files by the save token the Trainer has just written into ``trainer_state.json``."""
        self.wait()
        token = _agreed(_token_in(state))       # (each process drew one: the main process's is in the file)
        if token is None:
            raise OptionsError("LiferaftCallback: the Trainer's state holds no LiferaftSaveToken (was the callback "
                               "added after training started?)")
        path = os.path.join(self._folder(args, state), PART)
        full = self._state({"global_step": int(state.global_step), "token": token}, RNGState())
        if self.async_save:
            self._pending = async_save(path, full, options=self.options)
        else:
            save(path, full, options=self.options)
            self._retain()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.wait()

    def wait(self) -> None:
        """Wait for the save in flight (``async_save=True``) to commit, then apply ``keep_last``; raises the
        save's error (then nothing is removed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            self._retain()

    def _retain(self) -> None:
        """``keep_last``: on the process that writes the Trainer's files, keep the ``keep_last`` resumable
        ``checkpoint-<step>`` folders whose parts committed last (``last_checkpoint``'s order: after a roll-back,
        the abandoned run's higher steps count as older) and the Trainer's best one; remove the other resumable
        ones, and folders that are not resumable (killed saves, links: removed themselves, never followed) below
        the lowest step kept — never one above it (the Trainer's files of the save about to start are there)."""
        args = self.trainer.args
        if self.keep_last is None or not args.should_save:
            return
        folders = _folders(args.output_dir)
        ready = sorted(((at, step, path) for step, path in folders
                        if (at := committed_at(path, step)) is not None), reverse=True)
        if len(ready) <= self.keep_last:
            return
        kept = {path for _, _, path in ready[:self.keep_last]}
        lowest = min(step for _, step, _ in ready[:self.keep_last])
        best = self.trainer.state.best_model_checkpoint
        resumable = {path for _, _, path in ready}
        for step, path in folders:
            if path in kept or (best and os.path.abspath(best) == os.path.abspath(path)):
                continue
            if path in resumable or step < lowest:
                if os.path.islink(path) or not os.path.isdir(path):
                    os.remove(path)
                else:
                    shutil.rmtree(path, ignore_errors=True)

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
        hint = (f"resume from last_checkpoint(output_dir) instead "
                f"({last_checkpoint(args.output_dir) or 'none in ' + os.fspath(args.output_dir)})"
                + ("" if self.resume_from else ", or pass LiferaftCallback(resume_from=...) when the Trainer resumes "
                   "from a checkpoint outside output_dir"))
        if not committed(path):
            raise StateMismatchError(
                f"the Trainer resumes from step {state.global_step} but {path} holds no committed liferaft "
                f"checkpoint (a save killed midway, or a checkpoint written without LiferaftCallback); {hint}")
        saved: dict[str, Any] = {"trainer": {"global_step": 0, "token": ""}}
        load(path, saved, strict=False, options=self.load_options)     # the progress alone, nothing live yet
        expected = {"global_step": int(state.global_step), "token": _token_in(state)}
        if saved["trainer"] != expected:
            raise StateMismatchError(
                f"{path} was saved at step {saved['trainer'].get('global_step')} with save token "
                f"{saved['trainer'].get('token')!r}, but the Trainer resumed at step {expected['global_step']} "
                f"with token {expected['token']!r} (its trainer_state.json): it is not the liferaft part of the "
                f"checkpoint the Trainer resumed from (another run's, or this step saved again and killed before "
                f"its part committed). Nothing was loaded; {hint}")
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


class LiferaftSaveToken(TrainerCallback, ExportableState):
    """Ties each liferaft part to the Trainer's own files of the same checkpoint: the Trainer asks it for its
    state while it writes ``trainer_state.json`` (``stateful_callbacks``), and each time it answers with a fresh
    random token, which ``LiferaftCallback`` saves into the part. ``LiferaftCallback`` adds it to the Trainer."""

    def __init__(self) -> None:
        self.token = ""

    def state(self) -> dict[str, Any]:
        self.token = uuid.uuid4().hex
        return {"args": {}, "attributes": {"token": self.token}}


def _token_in(state: TrainerState) -> str | None:
    """The save token in the Trainer's state: written with its last checkpoint, or read back from the
    ``trainer_state.json`` it resumed from."""
    entry = (state.stateful_callbacks or {}).get(LiferaftSaveToken.__name__)
    entry = entry[-1] if isinstance(entry, list) and entry else entry
    token = entry.get("attributes", {}).get("token") if isinstance(entry, dict) else None
    return token if isinstance(token, str) and token else None


def _agreed(token: str | None) -> str | None:
    """The main process's token on every process (the Trainer asks every process's ``LiferaftSaveToken``, and the
    main process writes ``trainer_state.json``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return token
    box = [token]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
