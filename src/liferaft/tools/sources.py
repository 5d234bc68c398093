"""Loading from checkpoints liferaft did not write: a Hugging Face safetensors folder (or file) as the source of
``liferaft.load``, so a fine-tuning job starts from a pretrained model without converting it first.

Each rank memory-maps the safetensors files and copies into each of its shards (tensors, DTensor shards,
``Sharded``) exactly the box it holds: only those bytes are read from disk. Safetensors carry no checksums, so
these bytes cannot be verified (liferaft checkpoints always are); shapes and dtypes are checked.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from liferaft.errors import StateMismatchError
from liferaft.options import LoadResult
from liferaft.state.flatten import flatten
from liferaft.tools.convert import INDEX, safetensors_state


def is_safetensors_source(path: Any) -> bool:
    """True for a ``.safetensors`` file or a folder with ``model.safetensors`` or its index and no liferaft commit."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    p = os.fspath(path)
    if os.path.isfile(p):
        return p.endswith(".safetensors")
    return not os.path.exists(os.path.join(p, "COMMIT")) and (
        os.path.isfile(os.path.join(p, "model.safetensors")) or os.path.isfile(os.path.join(p, INDEX)))


def load_safetensors(path: str | os.PathLike[str], state: Any, strict: bool = True) -> LoadResult:
    """Fill ``state`` in place from a safetensors source (this rank's shards only). Keys are the state's keys
    (pass the module itself, or its state dict, for Hugging Face names)."""
    import time

    t0 = time.perf_counter()
    src = safetensors_state(path)
    flat = flatten(state)
    missing = [leaf.key for leaf in flat.tensors if leaf.key not in src]
    unexpected = sorted(set(src) - {leaf.key for leaf in flat.tensors})
    if strict and (missing or unexpected):
        raise StateMismatchError(f"{os.fspath(path)}: the state does not match the safetensors (nothing loaded); "
                                 f"missing {missing[:10]}, unexpected {unexpected[:10]}; pass strict=False to load "
                                 "the keys that match")
    for leaf in flat.tensors:
        t = src.get(leaf.key)
        if t is None:
            continue
        if tuple(t.shape) != leaf.shape or t.dtype != leaf.dtype:
            raise StateMismatchError(f"key {leaf.key!r}: the safetensors hold {list(t.shape)} {t.dtype}, the state "
                                     f"{list(leaf.shape)} {leaf.dtype}; nothing more was loaded")
    nbytes = 0
    with torch.no_grad():
        for leaf in flat.tensors:
            t = src.get(leaf.key)
            if t is None:
                continue
            for (offsets, sizes), local in leaf.parts:
                view = t
                for d, (o, n) in enumerate(zip(offsets, sizes)):
                    view = view.narrow(d, o, n)
                local.copy_(view)
                nbytes += local.numel() * local.element_size()
    for _, adapter, sd in reversed(flat.statefuls):
        adapter.load_state_dict(sd)
    return LoadResult(path=os.fspath(path), rank=0, bytes_read=nbytes, missing_keys=tuple(missing),
                      unexpected_keys=tuple(unexpected), timings={"total": time.perf_counter() - t0})


def is_dcp_source(path: Any) -> bool:
    """True for a local PyTorch DCP checkpoint folder (a ``.metadata`` file, no liferaft commit)."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    p = os.fspath(path)
    return os.path.isfile(os.path.join(p, ".metadata")) and not os.path.exists(os.path.join(p, "COMMIT"))


def load_dcp(path: str | os.PathLike[str], state: Any, strict: bool = True, process_group: Any = None) -> LoadResult:
    """Fill ``state`` in place from a PyTorch DCP checkpoint with DCP's own loader (collective when a process group
    is initialized; DCP reads and reshards): tensors and DTensors under the same flattened keys
    ("model.layer.weight"); ``Sharded`` leaves are not supported by DCP."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from liferaft.state.sharded import Sharded

    t0 = time.perf_counter()
    flat = flatten(state)
    meta = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    targets: dict[str, Any] = {}
    for leaf in flat.tensors:
        obj = flat.nodes[leaf.path[:-1]][leaf.path[-1]]
        if isinstance(obj, Sharded):
            raise StateMismatchError(f"key {leaf.key!r}: a Sharded leaf cannot be loaded from DCP; convert the "
                                     "checkpoint first (liferaft convert SRC DST --to liferaft)")
        if leaf.key in meta.state_dict_metadata:
            targets[leaf.key] = obj
    missing = [leaf.key for leaf in flat.tensors if leaf.key not in meta.state_dict_metadata]
    unexpected = sorted(set(meta.state_dict_metadata) - {leaf.key for leaf in flat.tensors})
    if strict and (missing or unexpected):
        raise StateMismatchError(f"{os.fspath(path)}: the state does not match the DCP checkpoint (nothing loaded); "
                                 f"missing {missing[:10]}, unexpected {unexpected[:10]}; pass strict=False")
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(targets, storage_reader=dcp.FileSystemReader(os.fspath(path)), no_dist=no_dist,
             process_group=process_group)
    for _, adapter, sd in reversed(flat.statefuls):
        adapter.load_state_dict(sd)
    nbytes = sum(leaf.parts[0][1].numel() * leaf.parts[0][1].element_size() for leaf in flat.tensors
                 if leaf.key in targets and leaf.parts)
    return LoadResult(path=os.fspath(path), rank=0 if no_dist else dist.get_rank(), bytes_read=nbytes,
                      missing_keys=tuple(missing), unexpected_keys=tuple(unexpected),
                      timings={"total": time.perf_counter() - t0})
