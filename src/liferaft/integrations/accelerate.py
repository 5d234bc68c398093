"""liferaft as Hugging Face Accelerate's checkpoint engine: ``save_state(accelerator, path)`` and
``load_state(accelerator, path)`` in place of ``accelerator.save_state(path)`` / ``accelerator.load_state(path)``.

Importing this module imports ``accelerate`` (``pip install liferaft[hf]``); ``import liferaft`` never does.

What is saved — every object the accelerator prepared or was given to checkpoint: each model (unwrapped from DDP;
an FSDP2 model's DTensor shards as they are), each optimizer and learning-rate scheduler (unwrapped from
Accelerate's wrappers), each object registered with ``accelerator.register_for_checkpointing``, the gradient
scaler (fp16), the position in a gradient-accumulation window (``accelerator.step``), the random streams of every
rank (``liferaft.RNGState``) and ``extra`` (the user's step counter, data position, anything else) — as
one liferaft checkpoint, collectively over the accelerator's processes: replicated tensors written once, the
writes spread over the ranks, asynchronously if asked. ``load_state`` loads it into the same objects on any number
of processes and any layout liferaft reshards between (DDP on 2 → 1 or 3 processes; FSDP2 ↔ DDP), every byte
verified. The data position is the user's to record in ``extra`` (e.g. the step, then
``accelerator.skip_first_batches(dataloader, n)`` when resuming): a dataloader's own iterator state is per rank and
would not survive a change of process count. The model exports to a folder ``from_pretrained`` loads with
``liferaft.convert(path, out, "hf", module="models.0", config=...)``. Not done: the hooks registered with
``accelerator.register_save_state_pre_hook`` / ``register_load_state_pre_hook`` are not called (they act on
Accelerate's own files: keep what they save, e.g. EMA weights, in ``extra`` or register it for checkpointing), and
dataloaders are not saved (above).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from accelerate import Accelerator

from liferaft.core.load import load
from liferaft.core.save import AsyncSaveHandle, save
from liferaft.core.save import async_save as _async_save
from liferaft.errors import OptionsError
from liferaft.options import LoadOptions, LoadResult, SaveOptions, SaveResult
from liferaft.state.rng import RNGState

__all__ = ["accelerator_state", "load_state", "save_state"]


def accelerator_state(accelerator: Accelerator, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state ``save_state`` saves and ``load_state`` loads into: ``{"models": {"0": model, ...},
    "optimizers": {...}, "schedulers": {...}, "custom": {...}, "rng": RNGState(), "extra": extra}`` (the
    accelerator's objects, unwrapped; ``extra`` as given: a dict whose values are loaded in place)."""
    if not isinstance(accelerator, Accelerator):
        raise OptionsError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if extra is not None and not isinstance(extra, Mapping):
        raise OptionsError(f"extra must be a dict of what else to save, got {type(extra).__name__}")
    state: dict[str, Any] = {
        "models": {str(i): accelerator.unwrap_model(m) for i, m in enumerate(accelerator._models)},
        "optimizers": {str(i): getattr(o, "optimizer", o) for i, o in enumerate(accelerator._optimizers)},
        "schedulers": {str(i): getattr(s, "scheduler", s) for i, s in enumerate(accelerator._schedulers)},
        "custom": {str(i): obj for i, obj in enumerate(accelerator._custom_objects)},
        "rng": RNGState(),
        "accumulation": _Step(accelerator),             # where in a gradient-accumulation window it is
    }
    if accelerator.scaler is not None:                  # fp16's loss scale and growth tracker
        state["scaler"] = accelerator.scaler
    if extra is not None:
        state["extra"] = extra
    return state


def save_state(accelerator: Accelerator, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None,
               async_save: bool = False, options: SaveOptions | None = None
               ) -> SaveResult | AsyncSaveHandle | None:
    """Save the accelerator's state (``accelerator_state``) to ``path`` (a folder, or ``s3://...``): collective,
    every process calls it. ``async_save=True`` returns once the snapshot is taken (an ``AsyncSaveHandle``: call
    ``wait()`` before the next save or at the end; None when ``options.if_busy="skip"`` skipped the save); else the
    ``SaveResult`` once committed."""
    state = accelerator_state(accelerator, extra)       # (Accelerate's processes: torch's default group)
    if async_save:
        return _async_save(os.fspath(path), state, options=options)
    return save(os.fspath(path), state, options=options)


def load_state(accelerator: Accelerator, path: str | os.PathLike[str], *,
               extra: MutableMapping[str, Any] | None = None, strict: bool = True,
               options: LoadOptions | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into the accelerator's objects, and the saved ``extra``'s values into
    ``extra`` (its keys updated): collective, every process calls it, after ``accelerator.prepare`` (the objects
    must exist, on any number of processes). A state that does not match raises naming the keys, unless
    ``strict=False``."""
    state = accelerator_state(accelerator, extra)
    result = load(os.fspath(path), state, strict=strict, options=options)
    if extra is not None:
        extra.update(state["extra"])        # (plain values come back in a new dict: into the caller's)
    return result


class _Step:
    """``accelerator.step`` (micro-steps since the last optimizer step) as a stateful object."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self._accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step")
        if type(step) is not int or step < 0:
            raise OptionsError(f"the saved accelerator step must be a non-negative integer, got {step!r}")
        self._accelerator.step = step
