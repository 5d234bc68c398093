"""liferaft as PyTorch Lightning's checkpoint engine: ``Trainer(plugins=[LiferaftCheckpointIO()])``.

Importing this module imports ``lightning`` (``pip install liferaft[lightning]``); ``import liferaft`` never does.

Lightning builds the checkpoint (a dict: the model's ``state_dict``, the optimizers' and schedulers' states, the
loops' progress, the callbacks' states, hyperparameters) on every rank, and the DDP and single-device strategies
hand it to the ``CheckpointIO`` on rank 0 only (the state is replicated). This plugin saves it as a liferaft
checkpoint — a folder at the path Lightning names (``epoch=3-step=40.ckpt/``, ``last.ckpt/``) — from that process
alone. A save over an existing checkpoint (``last.ckpt`` again) replaces it atomically at its commit: a process
killed mid-save leaves the previous one loadable.

By default a save is finished when ``save_checkpoint`` returns, as Lightning's ``ModelCheckpoint`` assumes (it
checks the file for its ``-v1`` names, links ``last.ckpt`` to it, and removes the checkpoint ``save_top_k`` drops
right after). ``async_save=True`` returns once the tensors are copied into liferaft's reused, budgeted staging
buffers; the writing and commit run behind, and the plugin keeps Lightning's assumptions as far as it can: a new
checkpoint is written under a temporary name and renamed into place once committed (a path never holds a
half-written checkpoint), a checkpoint Lightning drops is removed only after the save in flight has committed, one
save is in flight at a time (the next waits for it and raises its error), and ``teardown``, ``load_checkpoint``
and the interpreter's exit wait for it. What it cannot keep: a path exists only once its save committed, so
Lightning does not see it in between (use file names unique per save, the default ``{epoch}-{step}`` ones, and
``save_last=True`` rather than ``"link"``).

``load_checkpoint`` reads liferaft checkpoints and Lightning's own ``torch.save`` files (liferaft's reader:
``weights_only``, nothing run), every byte checked; every rank reads the whole checkpoint, as Lightning's own plugin
does. DDP checkpoints are world-size free: one saved by 2 processes resumes on 1 or 3. Sharded strategies never
hand their state to a ``CheckpointIO``: for FSDP2 and tensor parallelism, ``LiferaftModelParallelStrategy`` is
Lightning's ``ModelParallelStrategy`` saving and loading through liferaft itself. Not supported: Lightning's FSDP1
``FSDPStrategy`` and DeepSpeed (they write, and FSDP reads, their own files around the plugin), and
``LightningModule.load_from_checkpoint`` (it reads with ``torch.load`` itself: load with
``LiferaftCheckpointIO().load_checkpoint(path)["state_dict"]`` instead); docs/INTEGRATIONS.md.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import warnings
import weakref
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from liferaft.core.load import load
from liferaft.core.open import format_of
from liferaft.core.read import inspect, read
from liferaft.core.save import async_save, save
from liferaft.errors import LiferaftError, OptionsError
from liferaft.options import LoadOptions, SaveOptions
from liferaft.storage import resolve

__all__ = ["LiferaftCheckpointIO", "LiferaftModelParallelStrategy"]


class LiferaftCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through liferaft (synchronously, or in the background with
    ``async_save=True``: see the module's docstring) and loads liferaft checkpoints and ``torch.save`` files.
    ``options`` are the saves' ``SaveOptions`` (compression, codecs, staging budget, ``allow_pickle`` for
    hyperparameters that are not plain values, ...; ``overwrite`` is always on: Lightning saves ``last.ckpt`` again
    and again); ``load_options`` the loads'."""

    def __init__(self, *, async_save: bool = False, options: SaveOptions | None = None,
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
        self._pending: tuple[str, threading.Thread, list[BaseException]] | None = None
        self._removals: list[str] = []          # dropped by Lightning: removed once the save in flight commits
        self._group: Any = None
        atexit.register(_flush_at_exit, weakref.ref(self))

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
        """Wait for the save in flight, if any, then remove what Lightning dropped meanwhile; raise the save's error
        (then nothing is removed: the older checkpoints stay)."""
        pending, self._pending = self._pending, None
        removals, self._removals = self._removals, []
        if pending is not None:
            pending[1].join()
            if pending[2]:
                raise pending[2][0]
        for target in removals:
            _remove(target)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("LiferaftCheckpointIO.save_checkpoint takes no storage_options (give SaveOptions to "
                            f"LiferaftCheckpointIO(options=...)); got {storage_options!r}")
        self.wait()                             # (one in flight: its error is raised here)
        target = os.fspath(path)
        local = "://" not in target
        if local:
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        if not self.async_save:
            save(target, checkpoint, process_group=self._alone(), options=self.options)
            return
        # a new local path: written under a temporary name, renamed into place once committed
        fresh = local and not os.path.lexists(target)
        where = f"{target}.liferaft-writing" if fresh else target
        if fresh and os.path.lexists(where):
            _remove(where)                      # (a save of a process killed before its commit; a link: itself)
        handle = async_save(where, checkpoint, process_group=self._alone(), options=self.options)
        if handle is None:                      # (if_busy="skip" in the options: nothing saved)
            return
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                handle.wait()
                if fresh:
                    os.rename(where, target)
            except BaseException as e:  # noqa: BLE001 - raised by wait() on the caller's thread
                errors.append(e)

        thread = threading.Thread(target=finish, name="liferaft-lightning-save", daemon=True)
        thread.start()
        self._pending = (os.path.abspath(target), thread, errors)

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
        if isinstance(out, dict) and _SHARDED in out:
            raise OptionsError(f"{os.fspath(path)} was saved by LiferaftModelParallelStrategy (the model and "
                               "optimizer shards, keyed by parameter name): resume it with that strategy; "
                               "nothing was loaded")
        if map_location is None:
            return out
        return _move(out, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (its folder, a file, or an ``s3://`` prefix): what Lightning's
        ``save_top_k`` drops — once the save in flight, if any, has committed (a newer checkpoint exists before an
        older one goes). A link is removed, never followed."""
        target = os.fspath(path)
        if self._pending is not None and self._pending[0] != os.path.abspath(target):
            self._removals.append(target)
            return
        self.wait()
        _remove(target)

    def teardown(self) -> None:
        self.wait()


class LiferaftModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism through DTensor, applied in the
    module's ``configure_model``) with its checkpoints saved and loaded through liferaft instead of PyTorch DCP.

    Lightning calls a sharded strategy's ``save_checkpoint`` on every rank (no ``CheckpointIO``). This one saves the
    checkpoint Lightning built — the loops, callbacks, schedulers, hyperparameters — with the model and the
    optimizers as they are (their DTensor shards, keyed by parameter name; nothing gathered), as one liferaft
    checkpoint at the path Lightning names, collectively: every rank writes its own shards, replicated values once.
    It is committed when ``save_checkpoint`` returns (Lightning's ``ModelCheckpoint`` acts on it at once). A save
    over an existing checkpoint (``last.ckpt``) replaces it at its commit.

    ``load_checkpoint`` (``fit(ckpt_path=...)``, after the model is sharded and the optimizers made) loads the
    model and optimizer shards into this run's layout — another rank count, FSDP2 ↔ FSDP2 × TP — every byte
    verified, the model's and optimizers' keys checked before any is read (strict), and returns the rest for
    Lightning to restore. A folder written by Lightning's own ``ModelParallelStrategy`` (DCP) still loads, through
    it. ``options`` / ``load_options``: the saves' ``SaveOptions`` (``overwrite`` always on) and the loads'
    ``LoadOptions``; the other arguments are ``ModelParallelStrategy``'s (``save_distributed_checkpoint`` must stay
    True: a liferaft checkpoint is always the shards)."""

    def __init__(self, data_parallel_size: Any = "auto", tensor_parallel_size: Any = "auto", *,
                 options: SaveOptions | None = None, load_options: LoadOptions | None = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise OptionsError("LiferaftModelParallelStrategy always saves the shards (save_distributed_checkpoint "
                               "must stay True); `liferaft convert` writes a single file from them")
        for name, value, kind in (("options", options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, kind):
                raise OptionsError(f"LiferaftModelParallelStrategy({name}=...) must be a {kind.__name__}, got "
                                   f"{type(value).__name__}")
        super().__init__(data_parallel_size, tensor_parallel_size, **kwargs)
        self.liferaft_options = SaveOptions(**{**(options or SaveOptions()).__dict__, "overwrite": True})
        self.liferaft_load_options = load_options or LoadOptions()

    def _live(self) -> dict[str, Any]:
        """The model and optimizers, as liferaft saves and loads them (parameter names, shards as they are)."""
        return {"state_dict": self.model,
                "optimizer_states": {str(i): getattr(o, "_optimizer", o) for i, o in enumerate(self.optimizers)}}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("LiferaftModelParallelStrategy.save_checkpoint takes no storage_options (give "
                            f"SaveOptions to the strategy's options=...); got {storage_options!r}")
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        if "://" not in path:
            if self.global_rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                if os.path.islink(path) or os.path.isfile(path):
                    os.remove(path)             # (a torch.save file or a link at that name: replaced, not followed)
            self.barrier()
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save(path, {**rest, **self._live(), _SHARDED: 1}, options=self.liferaft_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise OptionsError("LiferaftModelParallelStrategy never unpickles arbitrary objects "
                               "(weights_only=False)")
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        if format_of(path) != "liferaft":
            return super().load_checkpoint(path, weights_only=weights_only)
        info = inspect(path)
        tops = sorted({info.paths[k][0] if info.paths.get(k) else k.split(".")[0]
                       for k in [t.key for t in info.tensors] + list(info.values)})
        if _SHARDED not in tops:
            raise OptionsError(f"{path} was not saved by LiferaftModelParallelStrategy (a liferaft checkpoint "
                               "without its shards' layout: LiferaftCheckpointIO's, from rank 0 of a DDP or "
                               "single-device run, or another state): resume it with the strategy that saved it; "
                               "nothing was loaded")
        rest_keys = [str(k) for k in tops if k not in ("state_dict", "optimizer_states", _SHARDED)]
        rest = read(path, keys=rest_keys, options=self.liferaft_load_options) if rest_keys else {}
        opts = LoadOptions(**{**self.liferaft_load_options.__dict__,
                              "ignore_keys": (*self.liferaft_load_options.ignore_keys, *rest_keys, _SHARDED)})
        load(path, self._live(), options=opts)
        return dict(rest)


#: a value LiferaftModelParallelStrategy saves beside the shards: the plugin and the strategy each refuse the
#: other's checkpoints (their model and optimizer layouts differ) before anything is loaded
_SHARDED = "liferaft_sharded_strategy"


def _remove(target: str) -> None:
    """Remove a checkpoint: a local folder or file (a link itself, never its target), or every object under an
    object-store prefix (its ``COMMIT`` first: never a committed checkpoint with missing files)."""
    if "://" in target:
        st = resolve(target)
        names = st.list()
        for name in sorted(names, key=lambda n: n != "COMMIT"):
            st.delete(name)
    elif os.path.islink(target) or os.path.isfile(target):
        os.remove(target)
    elif os.path.isdir(target):
        shutil.rmtree(target)


def _flush_at_exit(ref: weakref.ref[LiferaftCheckpointIO]) -> None:
    """At the interpreter's exit: wait for a save still in flight (a ``trainer.save_checkpoint`` after ``fit``)."""
    io = ref()
    if io is None:
        return
    try:
        io.wait()
    except (LiferaftError, OSError) as e:
        warnings.warn(f"liferaft: a Lightning checkpoint save in flight at exit failed: {e}", stacklevel=1)


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
