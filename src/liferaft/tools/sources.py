"""Loading from checkpoints liferaft did not write: a Hugging Face safetensors folder (or file) or a PyTorch DCP
checkpoint as the source of ``liferaft.load``, so a job starts from a pretrained model or another framework's
checkpoint without converting it first.

Each rank memory-maps the files and copies into each of its shards (tensors, DTensor shards, ``Sharded``) exactly
the box it holds: only those pages are read from disk, whatever layout wrote the source. Neither format carries
checksums, so these bytes cannot be verified (liferaft checkpoints always are); shapes and dtypes are checked.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from liferaft.errors import StateMismatchError
from liferaft.options import LoadResult
from liferaft.state.flatten import flatten
from liferaft.state.matching import drop_absent, not_persisted, settle_missing
from liferaft.tools.convert import safetensors_state


def is_safetensors_source(path: Any) -> bool:
    """True for a ``.safetensors`` file or a folder with ``model.safetensors`` or its index and no liferaft commit
    (``tools.formats.sniff``, the detector every tool uses)."""
    from liferaft.formats.sources import sniff

    return sniff(path) == "safetensors"


def _everywhere(keys: list[str], skipped: list[str], process_group: Any) -> tuple[set[str], set[str]]:
    """The keys any rank of the job wants, and the saved keys any rank skips (buffers its modules do not persist,
    ``state.matching``), in one small collective when a process group is initialized: so that a key another rank
    holds (pipeline stages) is not "unexpected" here."""
    from liferaft.dist import Coordinator

    got = Coordinator(process_group).exchange((keys, skipped), what="the key check of a load")
    return {k for ks, _ in got for k in ks}, {k for _, ss in got for k in ss}


def load_safetensors(path: str | os.PathLike[str], state: Any, strict: bool = True,
                     process_group: Any = None) -> LoadResult:
    """Fill ``state`` in place from a safetensors source (this rank's shards only). Keys are the state's keys
    (pass the module itself, or its state dict, for Hugging Face names)."""
    import time

    t0 = time.perf_counter()
    src = safetensors_state(path)
    flat = flatten(state, template=True)
    missing, absent = settle_missing(flat, [leaf.key for leaf in flat.tensors if leaf.key not in src],
                                     saved=set(src))
    wanted, skipped = _everywhere([leaf.key for leaf in flat.tensors], not_persisted(flat, src), process_group)
    unexpected = sorted(set(src) - wanted - skipped)
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
    drop_absent(flat, absent)
    for _, adapter, sd in reversed(flat.statefuls):
        adapter.load_state_dict(sd)
    return LoadResult(path=os.fspath(path), rank=0, bytes_read=nbytes, missing_keys=tuple(missing),
                      unexpected_keys=tuple(unexpected), timings={"total": time.perf_counter() - t0},
                      skipped_keys=tuple(sorted(skipped & set(src))))


def load_dcp(path: str | os.PathLike[str], state: Any, strict: bool = True, process_group: Any = None) -> LoadResult:
    """Fill ``state`` in place from a PyTorch DCP checkpoint: each rank memory-maps the data files and copies into
    each of its boxes (tensors, DTensor shards, ``Sharded``) the parts of the saved chunks that overlap it, so it
    reads only those pages, whatever layout wrote them; no collective. Keys are DCP's flattened names
    ("model.layer.weight"). Plain values are set from DCP's (unpickled with ``weights_only=True``). DCP stores no
    checksums, so the bytes are not verified; shapes and dtypes are."""
    import time

    from liferaft.core.load import _assign
    from liferaft.formats.dcp import DcpCheckpoint, joined_value, value_parts

    t0 = time.perf_counter()
    ck = DcpCheckpoint(path)
    flat = flatten(state, template=True)
    wanted = [leaf.key for leaf in flat.tensors] + [k for k, _, _ in flat.values]
    parts = {k: value_parts(ck.values, k) for k, _, _ in flat.values}  # DCP splits nested plain values
    # numpy arrays and bytes over 64 KiB are tensor leaves of the state holding copies: they get new values
    fresh = {leaf.key: leaf for leaf in flat.tensors if leaf.kind != "tensor"}
    saved = set(ck.tensors) | set(ck.values)
    found = (set(ck.tensors) | (set(ck.values) & set(fresh))) & set(wanted) | {p for ps in parts.values() for p in ps}
    missing, absent = settle_missing(flat, [k for k in wanted if k not in found and not parts.get(k)],
                                     saved=saved)
    everywhere, skipped = _everywhere(wanted, not_persisted(flat, saved - found), process_group)
    unexpected = sorted(saved - found - everywhere - skipped)
    if strict and (missing or unexpected):
        raise StateMismatchError(f"{os.fspath(path)}: the state does not match the DCP checkpoint (nothing loaded); "
                                 f"missing {missing[:10]}, unexpected {unexpected[:10]}; pass strict=False to load "
                                 "the keys that match")
    for leaf in flat.tensors:
        if leaf.key in fresh:
            continue
        if leaf.key in ck.values:
            raise StateMismatchError(f"key {leaf.key!r}: a plain value in the DCP checkpoint, a tensor in the state")
        t = ck.tensors.get(leaf.key)
        if t is not None and (t.shape != leaf.shape or t.dtype != leaf.dtype):
            raise StateMismatchError(f"key {leaf.key!r}: the DCP checkpoint holds {list(t.shape)} {t.dtype}, the "
                                     f"state {list(leaf.shape)} {leaf.dtype}; nothing was loaded")
    nbytes = 0
    with torch.no_grad():
        for leaf in flat.tensors:
            if leaf.key in ck.tensors and leaf.key not in fresh:
                for (offsets, _), local in leaf.parts:
                    nbytes += ck.copy_box(leaf.key, offsets, local)
    for key, leaf in fresh.items():
        if key in ck.tensors:
            t = ck.tensors[key]
            full = torch.empty(t.shape, dtype=t.dtype)
            nbytes += ck.copy_box(key, (0,) * len(t.shape), full)
            _assign(flat, leaf.path, full.numpy() if leaf.kind == "numpy" else full.numpy().tobytes())
        elif key in ck.values:
            _assign(flat, leaf.path, ck.value(key))
    for key, p, _ in flat.values:
        if parts.get(key):
            _assign(flat, p, joined_value(key, parts[key], ck.value, ck.paths))
    drop_absent(flat, absent)
    for _, adapter, sd in reversed(flat.statefuls):
        adapter.load_state_dict(sd)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return LoadResult(path=os.fspath(path), rank=rank, bytes_read=nbytes, missing_keys=tuple(missing),
                      unexpected_keys=tuple(unexpected), timings={"total": time.perf_counter() - t0},
                      skipped_keys=tuple(sorted(skipped & saved)))
