"""Small valid foreign checkpoints, and structural rewrites of them, for tests that attack liferaft's readers
(shipped for users too: fuzz your own pipeline the same way).

Every builder writes real files with the format's own writer (``safetensors.torch.save_file``, ``torch.save``,
``torch.distributed.checkpoint.save`` on one process) and returns the path; the state it wrote is
``sample_state()`` unless one is given. The rewriters change a file in place and keep everything they were not
asked to change byte for byte, so a test can mutate one field and know what it mutated.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch


def sample_state() -> dict[str, torch.Tensor]:
    """Three small tensors of distinct dtypes and values (so that a tensor read from another's bytes differs)."""
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(10, 14, dtype=torch.int64),
            "c": torch.tensor([0.5, -1.5], dtype=torch.float16)}


def safetensors_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor] | None = None) -> str:
    """Write ``tensors`` (default ``sample_state()``) as one safetensors file at ``path``; returns the path."""
    import safetensors.torch

    safetensors.torch.save_file(dict(tensors if tensors is not None else sample_state()), os.fspath(path))
    return os.fspath(path)


def safetensors_folder(folder: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor] | None = None,
                       shards: int = 2) -> str:
    """Write ``tensors`` as a sharded Hugging Face folder: ``shards`` files ``model-0000i-of-0000n.safetensors``
    (keys dealt round-robin in sorted order) and ``model.safetensors.index.json`` mapping every key to its file.
    Returns the folder."""
    d = os.fspath(folder)
    os.makedirs(d, exist_ok=True)
    state = dict(tensors if tensors is not None else sample_state())
    keys = sorted(state)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: state[k] for k in keys[i::shards]}
        safetensors_file(os.path.join(d, name), part)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return d


def torch_file(path: str | os.PathLike[str], state: Any = None) -> str:
    """``torch.save(state)`` (default ``sample_state()``) at ``path`` (a zip archive); returns the path."""
    torch.save(state if state is not None else sample_state(), os.fspath(path))
    return os.fspath(path)


def dcp_folder(folder: str | os.PathLike[str], state: Mapping[str, Any] | None = None) -> str:
    """``torch.distributed.checkpoint.save(state)`` (default ``sample_state()``) into ``folder`` on this process
    alone (no process group); returns the folder."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dict(state if state is not None else sample_state()),
             storage_writer=dcp.FileSystemWriter(os.fspath(folder)), no_dist=True)
    return os.fspath(folder)


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """(the header as a dict, the data section's bytes) of a safetensors file written by a trusted writer."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def rewrite_safetensors_header(path: str | os.PathLike[str],
                               edit: Callable[[dict[str, Any]], Any] | None = None, *,
                               raw: bytes | None = None, data: bytes | None = None) -> bytes:
    """Rewrite the header of the safetensors file ``path`` in place with the 8-byte length prefix fixed up to
    match: ``edit(header)`` changes the parsed header (it may mutate it and return None, or return any JSON value
    to store instead), or ``raw`` gives the header's bytes outright (need not be JSON). ``data`` replaces the data
    section (default: kept). Returns the header bytes written."""
    header, old = read_safetensors_header(path)
    if raw is None:
        out = edit(header) if edit is not None else None
        raw = json.dumps(header if out is None else out).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + (old if data is None else data))
    return raw


def rewrite_zip_members(path: str | os.PathLike[str], edit: Callable[[dict[str, bytes]], Any]) -> None:
    """Rewrite a zip archive (a ``torch.save`` file) with its members as ``edit`` leaves them: ``edit`` gets
    {member name: bytes} in archive order and mutates it (delete, shorten, replace, add). The result is a valid
    zip archive, stored uncompressed, each member's data 64-byte aligned as ``torch.save`` writes it."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    edit(members)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, blob in members.items():
            info = zipfile.ZipInfo(name)
            pad = (-(buf.tell() + 30 + len(name.encode()) + 4)) % 64
            info.extra = struct.pack("<HH", 0xCAFE, pad) + b"\0" * pad    # align the data as torch.save does
            z.writestr(info, blob)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def rewrite_dcp_metadata(folder: str | os.PathLike[str], edit: Callable[[Any], Any]) -> None:
    """Rewrite a DCP folder's ``.metadata`` (written by a trusted writer: it is unpickled here): ``edit`` gets the
    ``Metadata`` object and mutates it (or returns a replacement object to pickle instead)."""
    path = os.path.join(os.fspath(folder), ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # a file this module's caller wrote with dcp_folder
    out = edit(meta)
    with open(path, "wb") as f:
        pickle.dump(meta if out is None else out, f)
