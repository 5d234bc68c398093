"""safetensors files and Hugging Face folders (single or sharded with ``model.safetensors.index.json``): the one
validator of their headers, their tensors as memory-mapped tensors, and their :class:`Reader`.

Every file is checked before it is opened (``hf_folder.st_files``: inside the folder, a regular file, named by the
index) and its header validated before anything is allocated from it (``read_st_header``). safetensors carry no
checksums: a reader copies the bytes as they are (``verified`` is False) and ``verify`` checks the structure and
reads every byte, which is all that can be done.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

from liferaft.errors import CorruptCheckpointError, InvalidStateError, OptionsError
from liferaft.format import jsonsafe
from liferaft.formats.base import CheckReport, Reader, TensorSpec, copy_from
from liferaft.formats.hf_folder import index_map, open_regular, st_files
from liferaft.formats.zipfiles import drain
from liferaft.state.dtypes import dtype_name, torch_dtype

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32",
             "uint64": "U64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
MAX_DIMS = 64                   # more dimensions than any tensor has (torch allows 64)
#: The largest safetensors header read (the ``safetensors`` package's own limit).
ST_HEADER_LIMIT = 100_000_000


def read_st_header(f: Any, name: str, size: int
                   ) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    """The one validator of a safetensors header, for every reader: ``f`` open at the start of a file of ``size``
    bytes (``name`` in messages). Returns ({key: (liferaft dtype, shape, begin, end)} with begin/end relative to
    the data, the data's offset in the file). Checked before anything is allocated from it: the 8-byte length
    (at most ``ST_HEADER_LIMIT`` and within the file), a UTF-8 JSON object without repeated keys, ``__metadata__`` a
    str → str object, each entry an object with a known ``dtype``, a ``shape`` of non-negative ints whose product
    stays far from overflowing, ``data_offsets`` two ints ``0 <= a <= b <= data size`` with ``b - a`` the
    tensor's bytes, the tensors tiling the data exactly (no overlap, hole or trailing byte). CorruptCheckpointError
    naming the file and key otherwise
    (InvalidStateError for a well-formed dtype liferaft does not know)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"file {name!r}: {why}; not a valid safetensors file (damaged, truncated or "
                                      "crafted)")
    head = f.read(8)
    if len(head) < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length; truncated")
    (n,) = struct.unpack("<Q", head)
    if n > ST_HEADER_LIMIT or 8 + n > size:
        raise bad(f"the header is said to take {n} bytes (at most {ST_HEADER_LIMIT}), the file has {size}; "
                  "truncated or damaged")
    raw = f.read(n)
    if len(raw) != n:
        raise bad("the file ended inside the header")
    # the one strict JSON reader: depth-limited, no NaN/Infinity, no repeated keys, UTF-8 only
    header = jsonsafe.loads(raw, f"file {name!r}: the header", ST_HEADER_LIMIT,
                            advice="not a valid safetensors file (damaged, truncated or crafted)")
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("its __metadata__ is not an object of strings")
    data = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}

    def is_int(x: Any) -> bool:
        return type(x) is int                                   # not bool, not float
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        what = f"tensor {key!r}"
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
            raise bad(f"{what}: its entry is not an object with dtype, shape and data_offsets")
        dt, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dt, str):
            raise bad(f"{what}: dtype {dt!r} is not a name")
        if dt not in FROM_ST:
            raise InvalidStateError(f"file {name!r}: tensor {key!r} has dtype {dt[:40]}, unknown to liferaft")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
            raise bad(f"{what}: shape {str(shape)[:100]} is not a list of at most {MAX_DIMS} non-negative integers")
        span = 1
        for d in shape:
            span *= max(d, 1)
            if span > 1 << 62:
                raise bad(f"{what}: shape {str(shape)[:100]} is absurdly large")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(x) for x in offsets):
            raise bad(f"{what}: data_offsets {str(offsets)[:100]} are not two integers")
        a, b = offsets
        itemsize = torch_dtype(FROM_ST[dt]).itemsize
        numel = math.prod(shape)
        if not 0 <= a <= b:
            raise bad(f"{what}: data_offsets {a}..{b} are not an ascending pair of positions")
        if b - a != numel * itemsize:
            raise bad(f"{what}: data_offsets {a}..{b} hold {b - a} bytes, its {dt} {shape} takes "
                      f"{numel * itemsize}")
        if b > data:
            raise bad(f"{what}: its bytes end at {8 + n + b}, the file has {size}; truncated")
        out[key] = (FROM_ST[dt], tuple(shape), a, b)
    # The tensors must tile the data section exactly, as the safetensors library itself demands (it refuses a
    # file otherwise, so every writer of the ecosystem, liferaft's export included, writes them so): no overlap —
    # a tensor would be read from another's bytes, the silent wrong load — and no hole or trailing bytes either.
    # A hole is not merely waste: with the sizes fixed, a shifted data_offsets pair that stays in bounds leaves
    # one, so refusing holes turns a damaged offset into an error instead of a tensor read from the wrong bytes.
    spans = sorted((a, b, k) for k, (_, _, a, b) in out.items())
    end, last = 0, None
    for a, b, k in spans:
        if a < end:
            raise bad(f"tensors {last!r} and {k!r} overlap in the file")
        if a > end:
            raise bad(f"bytes {end}..{a} of the data lie between tensors ({last!r} and {k!r}), which no tensor "
                      "covers; a damaged offset or a crafted file")
        end, last = b, k
    if end != data:
        raise bad(f"the tensors cover {end} bytes of the data, the file holds {data}; damaged, truncated or crafted")
    return out, 8 + n


def safetensors_state(src: str | os.PathLike[str], keys: Collection[str] | None = None,
                      rename: Callable[[str], str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or Hugging Face folder as a flat dict of memory-mapped (copy-on-write)
    tensors: nothing is read until used. Every file is checked first (``hf_folder.st_files``) and its header
    validated (``formats.read_st_header``): CorruptCheckpointError naming the file and key."""
    rn = rename or (lambda k: k)
    out: dict[str, torch.Tensor] = {}
    found: dict[str, str] = {}                  # key -> the file that holds it
    index = index_map(os.fspath(src))
    for path in st_files(os.fspath(src)):
        with open_regular(path, path, CorruptCheckpointError, what="safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            tensors, start = read_st_header(f, path, size)
            data = np.memmap(f, dtype=np.uint8, mode="c", offset=start) if size > start \
                else np.zeros(0, dtype=np.uint8)
        for key, (dtype, shape, a, b) in tensors.items():
            if key in found:
                raise CorruptCheckpointError(f"tensor {key!r} is in both {found[key]!r} and {path!r}; which one "
                                             "holds it is ambiguous (a damaged or crafted folder)")
            found[key] = path
            if index is not None and index.get(key) != os.path.basename(path):
                raise CorruptCheckpointError(
                    f"file {path!r} holds tensor {key!r}, which the folder's index places "
                    f"{'in ' + repr(index[key]) if key in index else 'nowhere'}; the folder is damaged or crafted")
            if keys is not None and key not in keys:
                continue
            if rn(key) in out:
                raise OptionsError(f"the renaming maps two tensors to {rn(key)!r}")
            out[rn(key)] = torch.empty(shape, dtype=torch_dtype(dtype)) if a == b else \
                torch.from_numpy(data[a:b]).view(torch_dtype(dtype)).reshape(shape)
    if index is not None and set(index) - set(found):
        missing = sorted(set(index) - set(found))
        raise CorruptCheckpointError(f"{src}: the index names {len(missing)} tensor(s) no shard holds "
                                     f"({', '.join(repr(k) for k in missing[:5])}); the folder is incomplete")
    return out


def check_file(file: str, name: str, progress: Callable[[int], None] | None) -> tuple[int, list[str]]:
    """(bytes read, faults) of one safetensors file: its header validated (``read_st_header``: a fault is the
    first thing wrong there), then every data byte read."""
    try:
        with open_regular(file, name, CorruptCheckpointError, what="file") as f:
            size = os.fstat(f.fileno()).st_size
            read_st_header(f, name, size)
            done = drain(f, progress)                  # every data byte read: I/O errors show
    except (CorruptCheckpointError, InvalidStateError) as e:
        return 0, [str(e)]
    return done, []


def verify_files(path: str, progress: Callable[[int], None] | None = None) -> CheckReport:
    """Every safetensors file of ``path`` (a file, or a folder through its index) checked: its header validated
    and every data byte read. A folder whose index is unusable raises (CorruptCheckpointError); a damaged file is
    a fault of the report."""
    files = st_files(path)
    nbytes, faults = 0, []
    for file in files:
        n, fs = check_file(file, os.path.relpath(file, path) if file != path else os.path.basename(path), progress)
        nbytes += n
        faults += fs
    if not faults:                      # every file sound: then the keys across them (one file each, as indexed)
        try:
            safetensors_state(path)
        except CorruptCheckpointError as e:
            faults.append(str(e))
    return CheckReport(path=path, fmt="safetensors", units=0, checked_bytes=0, bytes_read=nbytes,
                       unchecked=("safetensors carry no checksums",), faults=tuple(faults))


class SafetensorsReader(Reader):
    """A safetensors file or Hugging Face folder: every tensor memory-mapped (copy-on-write; only the pages of the
    boxes read are touched), no plain values, keys as stored (flat)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._mapped = safetensors_state(path)
        super().__init__(url=os.fspath(path), fmt="safetensors", values={}, tensors={
            k: TensorSpec(key=k, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                          boxes=(((0,) * t.dim(), tuple(t.shape)),), nbytes=t.numel() * t.element_size())
            for k, t in self._mapped.items()})

    def value(self, key: str) -> Any:
        raise KeyError(key)                             # safetensors hold tensors only

    def copy_box(self, key: str, offsets: Any, out: torch.Tensor) -> int:
        return copy_from(self._mapped[key], offsets, out)

    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        return verify_files(self.url, progress)

    def close(self) -> None:
        self._mapped = {}
