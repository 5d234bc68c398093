"""liferaft as PyTorch Lightning's checkpoint engine: ``Trainer(plugins=[LiferaftCheckpointIO()])``.

Importing this module imports ``lightning`` (``pip install liferaft[lightning]``); ``import liferaft`` never does.

Lightning builds the checkpoint (a dict: the model's ``state_dict``, the optimizers' and schedulers' states, the
loops' progress, the callbacks' states, hyperparameters) on every rank, and its strategies hand it to the
``CheckpointIO`` on rank 0 only (DDP and single-device strategies: the state is replicated). This plugin then saves
it as a liferaft checkpoint — a folder at the path Lightning names (``epoch=3-step=40.ckpt/``, ``last.ckpt/``) — from
that process alone, asynchronously: ``save_checkpoint`` returns once the tensors are copied into liferaft's reused,
budgeted staging buffers; the encoding, writing and commit run behind. One save is in flight at a time (the next
waits for it, and raises its error); ``teardown`` (end of ``fit``), ``load_checkpoint`` and ``remove_checkpoint``
wait for it too. A checkpoint exists once committed: a process killed mid-save leaves the previous ``last.ckpt``
loadable (a save over an existing checkpoint replaces it atomically at its commit), never a half-written one.

``load_checkpoint`` reads liferaft checkpoints and, so that switching keeps old runs resumable, Lightning's own
``torch.save`` files (through liferaft's reader: ``weights_only``, nothing run), every byte checked; every rank reads
the whole checkpoint, as Lightning's own plugin does. DDP checkpoints are world-size free: one saved by 2 processes
resumes on 1 or 3. Sharded strategies (FSDP, ModelParallel) write their own distributed checkpoints and do not go
through a ``CheckpointIO``; use ``liferaft.convert`` / ``liferaft.load`` on those (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from liferaft.core.read import read
from liferaft.core.save import AsyncSaveHandle, async_save, save
from liferaft.errors import OptionsError
from liferaft.options import LoadOptions, SaveOptions

__all__ = ["LiferaftCheckpointIO"]


class LiferaftCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through liferaft (asynchronously unless ``async_save=False``) and
    loads liferaft checkpoints and ``torch.save`` files. ``options`` are the saves' ``SaveOptions`` (compression,
    codecs, staging budget, ``allow_pickle`` for hyperparameters that are not plain values, ...; ``overwrite`` is
    always on: Lightning saves ``last.ckpt`` again and again); ``load_options`` the loads'."""

    def __init__(self, *, async_save: bool = True, options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None) -> None:
        if not isinstance(async_save, bool):
            raise OptionsError(f"LiferaftCheckpointIO(async_save=...) must be True or False, got {async_save!r}")
        for name, value, kind in (("options", options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, kind):
                raise OptionsError(f"LiferaftCheckpointIO({name}=...) must be a {kind.__name__}, got "
                                   f"{type(value).__name__}")
        self.async_save = async_save
        self.options = SaveOptions(**{**(options or SaveOptions()).__dict__, "overwrite": True})
        self.load_options = load_options
        self._pending: tuple[str, AsyncSaveHandle] | None = None
        self._group: Any = None

    def _alone(self) -> Any:
        """A process group of this process alone (Lightning calls the plugin on rank 0 only): made once, by this
        process only (``use_local_synchronization``), so that the save runs no collective with the other ranks."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self._group

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].wait()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("LiferaftCheckpointIO.save_checkpoint takes no storage_options (give SaveOptions to "
                            f"LiferaftCheckpointIO(options=...)); got {storage_options!r}")
        self.wait()                             # (one in flight: its error is raised here)
        target = os.fspath(path)
        if not self.async_save:
            save(target, checkpoint, process_group=self._alone(), options=self.options)
            return
        handle = async_save(target, checkpoint, process_group=self._alone(), options=self.options)
        if handle is not None:
            self._pending = (os.path.abspath(target), handle)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint at ``path`` (a liferaft checkpoint or a ``torch.save`` file), tensors on the CPU or moved
        by ``map_location`` (a device, a string, or a callable taking ``(tensor, "cpu")``; a dict mapping is not
        supported). ``weights_only=False`` is refused: nothing is unpickled beyond what liferaft's options
        allow."""
        if weights_only is False:
            raise OptionsError("LiferaftCheckpointIO never unpickles arbitrary objects (weights_only=False); pickled "
                               "values load only as SaveOptions(allow_pickle=True) saved them and "
                               "LoadOptions(allow_pickle=True) allows")
        self.wait()
        out = read(os.fspath(path), options=self.load_options)
        if map_location is None:
            return out
        return _move(out, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (its folder, or a file): what Lightning's ``save_top_k`` drops. A link
        is removed, never followed."""
        target = os.fspath(path)
        if self._pending is not None and self._pending[0] == os.path.abspath(target):
            self.wait()
        if os.path.islink(target) or os.path.isfile(target):
            os.remove(target)
        elif os.path.isdir(target):
            shutil.rmtree(target)

    def teardown(self) -> None:
        self.wait()


def _move(tree: Any, where: Any) -> Any:
    """``tree`` with its tensors moved as ``torch.load``'s ``map_location`` would (a device or a callable)."""
    if isinstance(where, dict):
        raise OptionsError("LiferaftCheckpointIO.load_checkpoint: map_location as a dict is not supported; pass a "
                           "device or a callable")
    if isinstance(tree, torch.Tensor):
        return where(tree, "cpu") if callable(where) else tree.to(where)
    if isinstance(tree, dict):                  # (liferaft.read gives plain dicts, lists and tuples)
        return {k: _move(v, where) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_move(v, where) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_move(v, where) for v in tree)
    return tree
