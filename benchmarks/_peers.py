"""Peer checkpoint libraries for the benchmark: ByteCheckpoint 0.0.2 and torchsnapshot 0.1.0, on the same state.

``peer_save(method, path, state, solo)`` / ``peer_load(method, path, targets, solo)`` take the benchmark state
(a nested dict of fp32 tensors, or of DTensors on a 1-D CPU mesh) like ``do_save`` / ``do_load`` in
``_bench_ranks.py``; loads are in place into ``targets``; saves are durable on return (files and folders
fsynced here, whatever the library did). Checked bit-exact on CPU/gloo, torch 2.13 (tiny states):

============================  ====================  =========================================================
case                          bytecheckpoint        torchsnapshot
============================  ====================  =========================================================
1 process: save / load        works                 works (``StateDict`` app state, loads in place)
2 ranks: save Shard(0)        works                 NO: DTensor unsupported (see ``UNSUPPORTED``)
2 ranks: load same layout     works                 NO (nothing to load: no 2-rank save)
2 ranks: reshard → Shard(1)   works                 NO (same)
2→1 into full tensors         works                 NO (same; and see the silent wrong data below)
============================  ====================  =========================================================

ByteCheckpoint: ``bytecheckpoint.save/load(path, {"model": module}, framework="fsdp2")``, ``module`` an
``nn.Module`` whose parameters share storage with the state's tensors (DTensor parameters on 2 ranks, as FSDP2
makes them; named by key path joined by "/", "." replaced by ":" since module names cannot hold dots).
- It needs ``torch.distributed`` initialised even in one process: a world-1 gloo group on a ``HashStore`` is
  created here and left in place (its gRPC coordinator and plan caches are bound to it).
- It accepts torch 2.13 only because its version check compares strings ("2.13.0" < "2.6.0").
- Its first save starts a gRPC server in a *spawned* child, which fails in daemonic processes such as
  ``run_ranks`` ranks ("AssertionError: daemonic processes are not allowed to have children"), so the daemon
  flag is lifted during the save (the server is daemonic itself and ends with the process).
- Its logger writes INFO lines to *stdout* unless BYTECHECKPOINT_LOGGING_LEVEL is set (ERROR here).
- TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set (as a default): it ``torch.load``s non-tensor items and extra_state,
  which weights_only refuses on torch >= 2.6; this tensor-only state never reaches those calls (loads pass
  without it too).
- ``framework="ddp"`` also works in one process; "fsdp" needs an FSDP1-wrapped module ("KeyError: None" in
  ``FSDP.set_state_dict_type`` otherwise).
- ``fast=True`` passes fast_saving / fast_loading; both work on CPU (1 process and 2 ranks, all cases above).
  fast_saving may return before the files are written (on a plan-cache hit), so it saves with
  ``global_steps=0`` (folder name unchanged) and rank 0 waits for the completion callback, which
  ByteCheckpoint only calls when global_steps is set.

torchsnapshot: ``Snapshot.take(path, {"state": StateDict(state)})`` / ``Snapshot(path).restore(...)``. It has
no DTensor support (see ``UNSUPPORTED``); its sharded type is the deprecated ShardedTensor. Converting each
DTensor to one (private ``torch.distributed._shard.sharded_tensor.init_from_local_shards``) works for the
2-rank save, same-layout load and 2→1 load, but not for the reshard (ShardedTensor cannot express Replicate):
not done here. Saving each rank's local shard as a plain tensor is not a sharded checkpoint (no global shape
or offsets), so the 2-rank cases are refused, not faked. Such a per-rank snapshot restored in one process
gives silently wrong data: restore() uses rank 0's manifest, cannot load the (256, 64) shard in place into the
(512, 64) target, so it puts rank 0's half, a new tensor, into the ``StateDict`` and leaves the target
untouched, with no error or warning. ``peer_load`` refuses snapshots of another world size and checks that
every target tensor was loaded.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from _common import fsync_path

PEERS = ("bytecheckpoint", "torchsnapshot")
FRAMEWORK = "fsdp2"          # ByteCheckpoint framework: DTensor parameters, DCP-style resharding planner
FAST_TIMEOUT_S = 1800.0      # ByteCheckpoint's own default write timeout (BYTECHECKPOINT_WRITE_CKPT_TIMEOUT)

UNSUPPORTED: dict[str, str] = {
    "torchsnapshot/dtensor": (
        "torchsnapshot 0.1.0 has no DTensor support: Snapshot.take fails with 'RuntimeError: .numpy() is not "
        "supported for tensor subclasses.' (torchsnapshot/serialization.py tensor_as_memoryview); its only "
        "sharded type is the deprecated ShardedTensor"),
    "torchsnapshot/world": (
        "torchsnapshot restores a snapshot taken by {saved} ranks on {now} rank(s) from one rank's manifest: "
        "plain tensors come back as that rank's local part, silently (not resharded)"),
}


def _env() -> None:
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")    # ByteCheckpoint torch.load()s pickles
    os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "ERROR")    # else INFO lines go to stdout


def available(method: str) -> str | None:
    """None if ``method`` can run here, else a one-line reason."""
    if method not in PEERS:
        return f"unknown peer {method!r} (known: {', '.join(PEERS)})"
    _env()
    try:
        importlib.import_module(method)
        if method == "bytecheckpoint" and not importlib.import_module("bytecheckpoint.api.save").FSDP2_ENABLED:
            return "bytecheckpoint: FSDP2Checkpointer failed to import"
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable
        return f"{method}: import failed: {type(e).__name__}: {e}".splitlines()[0]
    return None


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, prefix + (str(k),))
    else:
        yield prefix, node


def _has_dtensor(state: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for _, t in _leaves(state))


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _fsync_tree(path: str) -> None:
    """Every rank fsyncs its share of the files under ``path``; rank 0 the folders (and ``path``'s parent)."""
    rank, world = _rank_world()
    if world > 1:
        dist.barrier()
    walk = sorted(os.walk(path))
    files = [os.path.join(d, n) for d, _, names in walk for n in sorted(names)]
    mine = files[rank::world] + ([d for d, _, _ in walk] + [os.path.dirname(os.path.abspath(path))]
                                 if rank == 0 else [])
    for p in mine:
        fsync_path(p)
    if world > 1:
        dist.barrier()


# ---------------------------------------------------------------- ByteCheckpoint

def _ensure_pg() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def _module(state: dict[str, Any]) -> torch.nn.Module:
    """A module whose parameters are the state's tensors (same storage), named by key path."""
    m = torch.nn.Module()
    for path, t in _leaves(state):
        m.register_parameter("/".join(path).replace(".", ":"), torch.nn.Parameter(t, requires_grad=False))
    return m


@contextmanager
def _may_have_children() -> Iterator[None]:
    """Lift the daemon flag of this process (run_ranks ranks are daemonic) while ByteCheckpoint spawns."""
    proc = multiprocessing.current_process()
    was = proc.daemon
    if was:
        proc.daemon = False
    try:
        yield
    finally:
        if was:
            proc.daemon = True


def _bcp_save(path: str, state: dict[str, Any], fast: bool) -> None:
    import bytecheckpoint as bcp

    _ensure_pg()
    ckpt = {"model": _module(state)}
    with _may_have_children():
        if not fast:
            bcp.save(path, ckpt, framework=FRAMEWORK)
            return
        done = threading.Event()
        bcp.save(path, ckpt, framework=FRAMEWORK, fast_saving=True, global_steps=0,
                 ignore_append_global_steps_to_folder=True, callback=done.set)
    if dist.get_rank() == 0 and not done.wait(FAST_TIMEOUT_S):   # the callback runs on the coordinator only
        raise TimeoutError(f"bytecheckpoint fast_saving of {path}: not complete after {FAST_TIMEOUT_S:.0f} s")


def _bcp_load(path: str, targets: dict[str, Any], fast: bool) -> None:
    import bytecheckpoint as bcp

    _ensure_pg()
    bcp.load(path, {"model": _module(targets)}, framework=FRAMEWORK, fast_loading=fast)


# ---------------------------------------------------------------- torchsnapshot

def _ts_save(path: str, state: dict[str, Any]) -> None:
    from torchsnapshot import Snapshot, StateDict

    if _has_dtensor(state):
        raise NotImplementedError(UNSUPPORTED["torchsnapshot/dtensor"])
    Snapshot.take(path, app_state={"state": StateDict(state)})


def _ts_load(path: str, targets: dict[str, Any]) -> None:
    from torchsnapshot import Snapshot, StateDict

    if _has_dtensor(targets):
        raise NotImplementedError(UNSUPPORTED["torchsnapshot/dtensor"])
    snap = Snapshot(path)
    saved, now = snap.metadata.world_size, _rank_world()[1]
    if saved != now:
        raise NotImplementedError(UNSUPPORTED["torchsnapshot/world"].format(saved=saved, now=now))
    box = StateDict(targets)
    snap.restore({"state": box})
    # restore() loads in place where it can and otherwise swaps in new tensors; copy those, never drop them.
    restored = dict(_leaves(box.data))
    with torch.no_grad():
        for key, t in _leaves(targets):
            got = restored.get(key)
            if got is t:
                continue
            if not isinstance(got, torch.Tensor) or got.shape != t.shape or got.dtype != t.dtype:
                what = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise RuntimeError(f"torchsnapshot restored {'/'.join(key)} as {what}, "
                                   f"target is {t.dtype} {list(t.shape)}")
            t.copy_(got)


# ---------------------------------------------------------------- entry points

def _check(method: str) -> None:
    reason = available(method)
    if reason is not None:
        raise NotImplementedError(reason)


def peer_save(method: str, path: str, state: dict[str, Any], solo: bool, *, fast: bool = False) -> None:
    """Save ``state`` to folder ``path`` with peer ``method``, durably. ``solo``: one process, no process group
    of the caller's (ByteCheckpoint makes a world-1 one). ``fast``: ByteCheckpoint's fast_saving."""
    _check(method)
    if method == "bytecheckpoint":
        _bcp_save(path, state, fast)
    else:
        _ts_save(path, state)
    _fsync_tree(path)


def peer_load(method: str, path: str, targets: dict[str, Any], solo: bool, *, fast: bool = False) -> None:
    """Load folder ``path`` in place into ``targets`` (the saved structure, any layout the peer can reshard
    to). ``fast``: ByteCheckpoint's fast_loading."""
    _check(method)
    if method == "bytecheckpoint":
        _bcp_load(path, targets, fast)
    else:
        _ts_load(path, targets)
