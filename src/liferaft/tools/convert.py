"""Move checkpoints between formats: liferaft ↔ Hugging Face safetensors (single file or sharded with
``model.safetensors.index.json``), ``torch.save`` files (loaded with ``weights_only=True``) → liferaft, liferaft →
``torch.save`` and → PyTorch DCP (docs/CLI.md).

Safetensors are written and read here directly (the format is an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets"}}`` and the raw bytes): the export streams tensor by tensor (in
row slabs for large ones) and the import memory-maps the files, so a conversion holds about one slab, never the
whole state (the ``safetensors`` package writes a shard from tensors all in memory). Files written are checked
against the ``safetensors`` package in the tests. Keys can be selected (glob) and renamed (regex).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from liferaft.errors import InvalidStateError, OptionsError, StateMismatchError
from liferaft.reading import check_files, open_checkpoint, read
from liferaft.storage import resolve
from liferaft.storage.refs import with_references
from liferaft.tools._slabs import read_box, slabs
from liferaft.transfer.tensors import torch_dtype

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32",
             "uint64": "U64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
INDEX = "model.safetensors.index.json"


def _renamer(rename: Sequence[tuple[str, str]] | None):
    pats = [(re.compile(p), r) for p, r in (rename or ())]

    def apply(key: str) -> str:
        for p, r in pats:
            key = p.sub(r, key)
        return key
    return apply


def _selected(key: str, keys: Sequence[str] | None) -> bool:
    return not keys or any(fnmatch.fnmatchcase(key, p) for p in keys)


@dataclass(frozen=True)
class ConvertReport:
    files: tuple[str, ...]
    tensors: int
    bytes: int


def to_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, max_shard_bytes: int = 5 << 30,
                   dtype: str | None = None, keys: Sequence[str] | None = None,
                   rename: Sequence[tuple[str, str]] | None = None,
                   progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Export the tensors of liferaft checkpoint ``src`` to the folder ``dst`` as Hugging Face safetensors:
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most ``max_shard_bytes`` plus
    ``model.safetensors.index.json``. ``dtype`` (e.g. "bfloat16") casts floating-point tensors."""
    storage = with_references(resolve(src))
    m = open_checkpoint(storage)
    rn = _renamer(rename)
    cast = torch_dtype(dtype) if dtype else None
    picked = []
    for e in m.tensors:
        if e.kind != "tensor" or not _selected(e.key, keys):
            continue
        out_dtype = dtype if cast is not None and torch_dtype(e.dtype).is_floating_point else e.dtype
        if out_dtype not in ST_DTYPES:
            raise InvalidStateError(f"key {e.key!r}: dtype {out_dtype} has no safetensors name")
        size = int(np.prod(e.shape, dtype=np.int64)) * torch.empty(0, dtype=torch_dtype(out_dtype)).element_size()
        picked.append((e, rn(e.key), out_dtype, size))
    names = [p[1] for p in picked]
    if len(set(names)) != len(names):
        raise OptionsError("the renaming maps two keys to one name")
    check_files(storage, m, {c.file for e, *_ in picked for c in e.chunks})
    shards: list[list[Any]] = [[]]
    for p in picked:
        if shards[-1] and sum(q[3] for q in shards[-1]) + p[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(p)
    os.makedirs(dst, exist_ok=True)
    files, total, weight_map = [], 0, {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(storage, os.path.join(dst, name), shard, progress)
        files.append(name)
        for e, key, _, size in shard:
            weight_map[key] = name
            total += size
    if len(shards) > 1:
        with open(os.path.join(dst, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX)
    return ConvertReport(files=tuple(files), tensors=len(picked), bytes=total)


def _write_shard(storage: Any, path: str, shard: list[Any], progress: Callable[[int], None] | None = None) -> None:
    """One safetensors file, streamed: the header padded (with spaces, as the format allows) so that the data
    starts on a 4 KiB page, then each tensor in row slabs read into one page-aligned buffer and written with
    O_DIRECT where it is page-aligned (through the page cache a write runs at a fraction of the disk's speed)."""
    from liferaft.staging.pool import page_aligned_empty
    from liferaft.storage.posix import PosixStorage

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e, key, out_dtype, size in shard:
        header[key] = {"dtype": ST_DTYPES[out_dtype], "shape": list(e.shape), "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)
    folder, name = os.path.split(os.path.abspath(path))
    out = PosixStorage(folder)
    w = out.open_writer(name + ".tmp")
    try:
        w.pwrite(struct.pack("<Q", len(raw)) + raw, 0)
        at = 8 + len(raw)
        buf, stage = page_aligned_empty(SLAB), page_aligned_empty(SLAB)
        for e, _, out_dtype, _ in shard:
            for box in slabs(e, SLAB // 2 if out_dtype != e.dtype else SLAB):
                fits = e.itemsize * math.prod(box[1]) <= SLAB
                t = read_box(storage, e, box, 32 << 20, out=stage if fits else None)
                if out_dtype != e.dtype:
                    t = t.to(torch_dtype(out_dtype))
                data = t.contiguous().reshape(-1).view(torch.uint8)
                if progress is not None:
                    progress(data.numel())
                if out_dtype == e.dtype and fits:        # read straight into the aligned buffer: write it
                    w.pwrite(memoryview(stage[:data.numel()].numpy()), at)
                    at += data.numel()
                    continue
                n = data.numel()
                for lo in range(0, n, SLAB):                 # (a slab is one row when rows are huge)
                    m = min(SLAB, n - lo)
                    buf[:m].copy_(data[lo:lo + m])
                    w.pwrite(memoryview(buf[:m].numpy()), at)
                    at += m
        w.close()
    except BaseException:
        w.abort()
        raise
    os.replace(os.path.join(folder, name + ".tmp"), path)
    out.sync()


SLAB = 64 << 20


def _st_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(src, n) for n in dict.fromkeys(weight_map.values())]
    single = os.path.join(src, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise StateMismatchError(f"{src}: no model.safetensors or {INDEX} there")


def safetensors_state(src: str | os.PathLike[str], keys: Sequence[str] | None = None,
                      rename: Sequence[tuple[str, str]] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or Hugging Face folder as a flat dict of memory-mapped (copy-on-write)
    tensors: nothing is read until used."""
    rn = _renamer(rename)
    out: dict[str, torch.Tensor] = {}
    for path in _st_files(os.fspath(src)):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n) if os.path.getsize(path) > 8 + n \
            else np.zeros(0, dtype=np.uint8)
        for key, spec in header.items():
            if key == "__metadata__" or not _selected(key, keys):
                continue
            if spec["dtype"] not in FROM_ST:
                raise InvalidStateError(f"{path}: tensor {key!r} has dtype {spec['dtype']}, unknown to liferaft")
            a, b = spec["data_offsets"]
            t = torch.from_numpy(data[a:b]).view(torch_dtype(FROM_ST[spec["dtype"]])).reshape(spec["shape"])
            out[rn(key)] = t
    return out


def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
                     rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a safetensors file or Hugging Face folder (single or sharded) into a liferaft checkpoint at ``dst``
    (keys unchanged unless renamed; nested by nothing: a flat dict)."""
    import liferaft

    state = safetensors_state(src, keys, rename)
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=len(state), bytes=res.total_bytes)


def from_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, options: Any = None) -> ConvertReport:
    """Import a ``torch.save`` file (loaded with ``weights_only=True`` and memory-mapped: no code runs, nothing is
    read twice) into a liferaft checkpoint, nesting kept."""
    import liferaft

    state = torch.load(os.fspath(src), weights_only=True, mmap=True, map_location="cpu")
    if not isinstance(state, dict):
        state = {"state": state}
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=-1, bytes=res.total_bytes)


def to_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> ConvertReport:
    """Export to one ``torch.save`` file (the whole state in memory once: torch.save needs it)."""
    tree = read(src)
    torch.save(tree, os.fspath(dst))
    return ConvertReport(files=(os.fspath(dst),), tensors=-1, bytes=os.path.getsize(dst))


def to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> ConvertReport:
    """Export to a PyTorch DCP checkpoint in one process (the whole state in memory once)."""
    import torch.distributed.checkpoint as dcp

    tree = read(src)
    dcp.save(tree, storage_writer=dcp.FileSystemWriter(os.fspath(dst)), no_dist=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    return ConvertReport(files=(os.fspath(dst),), tensors=-1, bytes=size)


def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, options: Any = None) -> ConvertReport:
    """Import a PyTorch DCP checkpoint (one process; the whole state in memory once, as DCP's own converter)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(os.fspath(dst)))) as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(os.fspath(src), path)
        return from_torch(path, dst, options=options)
