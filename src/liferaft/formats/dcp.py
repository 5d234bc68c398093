"""PyTorch DCP's on-disk format, read here directly (written by ``formats.dcp_write``): no code from a checkpoint
runs.

A DCP checkpoint is a folder with ``.metadata`` (a pickle of ``torch.distributed.checkpoint.metadata.Metadata``:
per key a tensor's dtype, shape and chunks, or "bytes" for any other value; where each chunk and value lies) and
data files ``__<rank>_<i>.distcp`` holding one ``torch.save`` blob per tensor chunk and per value.

Reading (``DcpCheckpoint``): DCP itself unpickles ``.metadata`` with plain pickle and values with
``weights_only=False``; here ``.metadata`` is unpickled with an allowlist of DCP's metadata classes and torch
types, and values with ``weights_only=True``. A chunk's blob is loaded to the meta device (its header only) to learn
where the raw bytes lie and with which strides; the data file is memory-mapped there, so copying a box of a chunk
reads only the pages of that box. Chunks stored through DCP extensions (``transform_descriptors``, e.g. zstd) are
read whole through DCP's own transforms.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from liferaft.errors import (
    CorruptCheckpointError,
    LiferaftError,
    PickleNotAllowedError,
    StateMismatchError,
    UnsafePathError,
)
from liferaft.format.limits import MAX_NESTING
from liferaft.formats.base import BoxRead, CheckReport, Reader, ReadJob, ReadOutcome, TensorSpec, ValueSpec
from liferaft.formats.torch_checks import scan
from liferaft.formats.zipfiles import View, check_zip
from liferaft.planning.geometry import check_chunks_tile
from liferaft.state.dtypes import dtype_name
from liferaft.state.tree import nest
from liferaft.storage import files

#: Most bytes a chunk stored through a DCP extension (zstd, ...) may decode to per byte of its blob: more than any
#: codec's best ratio on real data (a zstd RLE block: 128 KiB from 4 bytes), so a crafted ``.metadata`` cannot
#: make a reader allocate more than this times what lies on disk.
MAX_EXPANSION = 1 << 15

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    # where older torch releases (≤ 2.2) pickled the tensor properties from
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str) -> None:
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise PickleNotAllowedError(
            f"{self.path}: refers to {module}.{name}, which DCP metadata never holds; liferaft does not unpickle it "
            "(a checkpoint never runs code here). Load it with DCP itself if you trust its author")


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: its box in the global tensor and where its blob lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class DcpTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty(0, dtype=self.dtype).element_size()


class DcpCheckpoint:
    """A DCP checkpoint folder opened for reading: ``tensors`` and ``values`` by key (DCP's flattened names),
    ``paths`` the nesting DCP recorded for each key (``planner_data``), when it did."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        path = os.path.join(self.folder, ".metadata")
        if not os.path.isfile(path):
            raise StateMismatchError(f"{self.folder}: no .metadata file: not a DCP checkpoint (or not a finished one)")
        self._inside(".metadata", ".metadata")          # a link to a file elsewhere is not this checkpoint's
        with self.open_file(path, ".metadata") as f:
            try:
                self.meta = _MetadataUnpickler(f, path).load()
            except PickleNotAllowedError:
                raise
            except Exception as e:
                raise CorruptCheckpointError(f"{path}: cannot be read as DCP metadata ({e})") from e
        from torch.distributed.checkpoint.metadata import Metadata

        if not isinstance(self.meta, Metadata):
            raise CorruptCheckpointError(f"{path}: holds a {type(self.meta).__qualname__}, not DCP Metadata")
        self.tensors: dict[str, DcpTensor] = {}
        self.values: dict[str, Any] = {}
        self.paths: dict[str, tuple[Any, ...]] = {}
        try:
            self._interpret(path)
        except (AttributeError, TypeError, ValueError, OverflowError, KeyError, RecursionError) as e:
            raise CorruptCheckpointError(f"{path}: the DCP metadata does not hold what DCP writes "
                                         f"({type(e).__name__}: {str(e)[:200]}); damaged or crafted") from None
        self._maps: dict[str, torch.UntypedStorage] = {}

    def _interpret(self, path: str) -> None:
        """Every field of the metadata checked for type and range before it is used: keys are strings, dtypes
        torch dtypes, shapes and offsets non-negative ints, each tensor's chunks tile it exactly (no overlap, no
        gap: a gap would leave memory unread), each blob a non-negative span of a file inside the folder."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        def ints(xs: Any, what: str, n: int | None = None) -> tuple[int, ...]:
            out = tuple(xs)
            if not all(type(x) is int and 0 <= x < 1 << 62 for x in out) or (n is not None and len(out) != n):
                raise ValueError(f"{what} {str(out)[:80]} are not {n if n is not None else 'some'} non-negative ints")
            return out
        storage = self.meta.storage_data or {}
        if not isinstance(storage, dict) or not isinstance(self.meta.state_dict_metadata, dict):
            raise TypeError("storage_data and state_dict_metadata must be dicts")
        by_key: dict[str, list[Any]] = {}
        for index, info in storage.items():
            by_key.setdefault(index.fqn, []).append((index, info))
        for key, md in self.meta.state_dict_metadata.items():
            if not isinstance(key, str):
                raise TypeError(f"key {key!r} is not a string")
            places = by_key.get(key, [])
            if isinstance(md, BytesStorageMetadata):
                if not places:
                    raise CorruptCheckpointError(f"{path}: value {key!r} has no storage entry")
                info = places[0][1]
                ints((info.offset, info.length), f"value {key!r}: offset and length", 2)
                self._inside(info.relative_path, key)
                self.values[key] = info
            elif isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                if not isinstance(dtype, torch.dtype):
                    raise TypeError(f"key {key!r}: dtype {dtype!r} is not a torch dtype")
                shape = ints(md.size, f"key {key!r}: shape")
                where = {tuple(ix.offset or ()): info for ix, info in places}
                chunks = []
                for c in md.chunks:
                    offsets = ints(c.offsets, f"key {key!r}: chunk offsets", len(shape))
                    sizes = ints(c.sizes, f"key {key!r}: chunk sizes", len(shape))
                    info = where.get(offsets)
                    if info is None:
                        raise CorruptCheckpointError(f"{path}: key {key!r}: chunk at {list(offsets)} has no "
                                                     "storage entry")
                    start, length = ints((info.offset, info.length), f"key {key!r}: blob offset and length", 2)
                    transforms = tuple(getattr(info, "transform_descriptors", None) or ())
                    need = math.prod(sizes) * dtype.itemsize
                    if need > (MAX_EXPANSION * length + (1 << 20) if transforms else length):
                        raise CorruptCheckpointError(
                            f"{path}: key {key!r}: chunk at {list(offsets)} holds {need} bytes ({list(sizes)} x "
                            f"{dtype}), more than its {length}-byte blob {'can decode to' if transforms else 'holds'}; "
                            "the DCP metadata is damaged or crafted")
                    chunks.append(DcpChunk(offsets, sizes, self._inside(info.relative_path, key), start, length,
                                           tuple(str(t) for t in getattr(info, "transform_descriptors", None) or ())))
                boxes = [(c.offsets, c.sizes) for c in chunks]
                outside = next((b for b in boxes if any(o + n > d for o, n, d in zip(*b, shape))), None)
                problem = (f"chunk at {list(outside[0])} (sizes {list(outside[1])}) lies outside {list(shape)}"
                           if outside is not None else
                           "a chunk is listed twice" if len(set(boxes)) != len(boxes) else
                           check_chunks_tile(shape, boxes))
                if problem:
                    raise CorruptCheckpointError(f"{path}: key {key!r}: {problem}; the DCP checkpoint is damaged")
                self.tensors[key] = DcpTensor(key, dtype, shape, tuple(chunks))
            else:
                raise TypeError(f"key {key!r}: {type(md).__name__} is neither tensor nor bytes metadata")
        self._check_spans(path)
        pd = self.meta.planner_data
        if isinstance(pd, dict):
            for k, v in pd.items():
                parts = tuple(v) if isinstance(v, (list, tuple)) else None
                if isinstance(k, str) and parts and all(type(x) in (str, int) for x in parts):
                    self.paths[k] = parts           # (a malformed entry: the key's dots are its nesting)
        at: dict[tuple[Any, ...], str] = {}
        for key in [*self.tensors, *self.values]:   # two keys at one path: a tree would keep one of them
            p = self.paths.get(key, tuple(key.split(".")))
            if len(p) > MAX_NESTING:
                raise CorruptCheckpointError(f"{path}: key {key:.100}...: its path has {len(p)} parts "
                                             f"(planner_data, else the key's dots), more than the {MAX_NESTING} "
                                             "liferaft nests; the DCP metadata is damaged or crafted")
            if p in at:
                raise CorruptCheckpointError(f"{path}: keys {at[p]!r} and {key!r} are both at path {list(p)!r:.200} "
                                             "(planner_data); the DCP metadata is damaged")
            at[p] = key

    def _check_spans(self, path: str) -> None:
        """Every blob's byte range inside its data file (files that exist: a missing one is reported where it is
        opened, and by ``verify``) and no two blobs of a file overlapping. DCP's own ``FileSystemReader`` trusts
        ``.metadata`` whole (it unpickles it with plain pickle, then slices each blob at the recorded offset and
        length and ``torch.load``s it): liferaft checks, beyond it, every field's type and range, the chunks
        tiling each tensor, these spans, and each blob's records and views (``formats.torch_checks.scan``) before
        a byte is copied."""
        spans = [(c.file, c.offset, c.offset + c.length, key) for key, t in self.tensors.items() for c in t.chunks]
        spans += [(self._inside(info.relative_path, key), int(info.offset), int(info.offset) + int(info.length), key)
                  for key, info in self.values.items()]
        spans.sort()
        sizes: dict[str, int | None] = {}
        for i, (file, a, b, key) in enumerate(spans):
            if file not in sizes:
                sizes[file] = os.path.getsize(file) if os.path.isfile(file) else None
            size = sizes[file]
            if size is not None and b > size:
                raise CorruptCheckpointError(f"{path}: key {key!r} is stored at bytes {a}..{b} of "
                                             f"{os.path.basename(file)!r}, which has {size}; truncated or crafted")
            if i and spans[i - 1][0] == file and a < spans[i - 1][2] and b > a:
                raise CorruptCheckpointError(f"{path}: keys {spans[i - 1][3]!r} and {key!r} are stored at "
                                             f"overlapping bytes of {os.path.basename(file)!r}; crafted or damaged")

    def _inside(self, relative: Any, key: str) -> str:
        """The data file a storage entry names, which must lie in the checkpoint's folder."""
        root = os.path.realpath(self.folder)
        path = os.path.realpath(os.path.join(root, str(relative)))
        if os.path.isabs(str(relative)) or not path.startswith(root + os.sep):
            raise UnsafePathError(f"{self.folder}: key {key!r} is stored at {relative!r}, outside the checkpoint "
                                  "folder; refusing to read it")
        if path != os.path.normpath(os.path.join(root, str(relative))):     # a link on the way, to anywhere
            raise UnsafePathError(f"{self.folder}: key {key!r} is stored at {relative!r}, which is (or lies under) "
                                  "a link: liferaft follows no link inside a checkpoint; put the file itself there")
        return path

    def open_file(self, path: str, what: str) -> io.BufferedReader:
        """The file ``path`` of this folder (checked by ``_inside``) opened through ``storage.files``: no link
        followed, a regular file only (a FIFO cannot hang it); a missing one is FileNotFoundError."""
        root = os.path.realpath(self.folder)
        fd = files.open_read(root, os.path.relpath(path, root).replace(os.sep, "/"), shown=f"{self.folder}: {what}")
        return os.fdopen(fd, "rb")

    def _blob(self, c: DcpChunk, key: str) -> Any:
        try:
            f = self.open_file(c.file, f"data file {os.path.basename(c.file)!r} (key {key!r})")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{c.file}: missing (key {key!r}); the DCP checkpoint is incomplete") \
                from None
        if os.fstat(f.fileno()).st_size < c.offset + c.length:
            f.close()
            raise CorruptCheckpointError(f"{c.file}: shorter than the metadata says (key {key!r}); truncated")
        return f

    def chunk(self, key: str, c: DcpChunk) -> torch.Tensor:
        """The chunk's values: memory-mapped copy-on-write (nothing read until used) for plain DCP blobs,
        materialized for chunks stored through DCP extensions."""
        t = self.tensors[key]
        with self._blob(c, key) as f:
            view = View(f, c.offset, c.length)
            try:
                if c.transforms:
                    return self._transformed(key, c, view)
                # the blob's pickle rebuilt on the meta device, its records and views checked (nothing read)
                meta, at = scan(io.BufferedReader(view), f"{c.file}: key {key!r}: chunk at {list(c.offsets)}")
            except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:
                raise CorruptCheckpointError(f"{c.file}: key {key!r}: chunk at {list(c.offsets)} is not a "
                                             f"readable torch.save blob ({e})") from e
        strided = isinstance(meta, torch.Tensor) and meta.layout == torch.strided and not meta.is_nested
        storage = meta.untyped_storage() if strided else None
        start = at.get(storage._cdata) if storage is not None else None
        if storage is None or start is None or meta.dtype != t.dtype or tuple(meta.shape) != c.sizes:
            raise CorruptCheckpointError(f"{c.file}: key {key!r}: chunk at {list(c.offsets)} holds "
                                         f"{getattr(meta, 'dtype', type(meta))} {list(getattr(meta, 'shape', []))}, "
                                         f"the metadata says {t.dtype} {list(c.sizes)}")
        nbytes = storage.nbytes()
        if start + nbytes > c.length:
            raise CorruptCheckpointError(f"{c.file}: key {key!r}: chunk data runs past its blob; truncated")
        raw = self._mapped(c.file, c.offset + start, nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        out = raw.view(t.dtype).as_strided(meta.shape, meta.stride(), meta.storage_offset())
        if meta.is_conj():                  # the blob holds the values before the lazy conjugate / negation
            out = out.conj()
        if meta.is_neg():
            out = out._neg_view()
        return out

    def _mapped(self, file: str, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``file`` from ``offset`` as a uint8 tensor of a private (copy-on-write) mapping of the
        file: nothing is read until used, and no descriptor stays open (a checkpoint of thousands of files maps
        them all). The bytes start at any address (DCP packs archives back to back), which ``view(dtype)`` of a
        slice would refuse, so the tensor is built on the address; it keeps the mapping alive."""
        storage = self._maps.get(file)
        if storage is None:
            storage = self._maps[file] = torch.UntypedStorage.from_file(file, shared=False,
                                                                       nbytes=os.path.getsize(file))
        window = (ctypes.c_uint8 * nbytes).from_address(storage.data_ptr() + offset)
        window.keep = storage                                   # the array owns a reference to its mapping
        return torch.from_numpy(np.frombuffer(window, dtype=np.uint8))

    def _transformed(self, key: str, c: DcpChunk, view: View) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        t = self.tensors[key]
        stream = dcp.FileSystemReader(self.folder).transforms.transform_load_stream(None, c.transforms, view)
        what = f"{c.file}: key {key!r}: chunk at {list(c.offsets)}"
        data = _bounded(stream, math.prod(c.sizes) * t.dtype.itemsize + (1 << 20), what)
        scan(data, what)
        out = torch.load(data, map_location="cpu", weights_only=True)
        if not isinstance(out, torch.Tensor) or out.dtype != t.dtype or tuple(out.shape) != c.sizes:
            raise CorruptCheckpointError(f"{what}: holds {getattr(out, 'dtype', type(out))} "
                                         f"{list(getattr(out, 'shape', []))}, the metadata says {t.dtype} "
                                         f"{list(c.sizes)}")
        return out

    def value(self, key: str) -> Any:
        """A non-tensor value, unpickled with ``weights_only=True`` (no code runs)."""
        info = self.values[key]
        file = self._inside(info.relative_path, key)
        c = DcpChunk((), (), file, int(info.offset), int(info.length),
                     tuple(getattr(info, "transform_descriptors", None) or ()))
        with self._blob(c, key) as f:
            view: Any = View(f, c.offset, c.length)
            if c.transforms:
                import torch.distributed.checkpoint as dcp

                view = dcp.FileSystemReader(self.folder).transforms.transform_load_stream(None, c.transforms, view)
            # a value decoded by an extension is bounded too: a decompression bomb stops at 64 x its blob
            data = _bounded(view, 64 * c.length + (16 << 20), f"{file}: value {key!r}")
        scan(data, f"{file}: value {key!r}")            # records and views checked before torch allocates them
        try:
            return torch.load(data, weights_only=True)
        except pickle.UnpicklingError as e:
            raise PickleNotAllowedError(f"{file}: value {key!r} is a pickled object that weights_only loading "
                                        f"refuses ({str(e).splitlines()[0]}); liferaft never runs code from a "
                                        "checkpoint") from e
        except (RuntimeError, EOFError, ValueError, OverflowError, TypeError, KeyError) as e:
            raise CorruptCheckpointError(f"{file}: value {key!r} is not a readable torch.save blob "
                                         f"({(str(e).splitlines() or [''])[0][:200]})") from e

    def overlapping(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> list[DcpChunk]:
        """The saved chunks of ``key`` that the box (``offsets``, ``sizes``) overlaps."""
        return [c for c in self.tensors[key].chunks
                if all(max(o, co) < min(o + n, co + cn) for o, n, co, cn in zip(offsets, sizes, c.offsets, c.sizes))]

    def copy_box(self, key: str, offsets: Sequence[int], out: torch.Tensor,
                 opened: Mapping[DcpChunk, torch.Tensor] | None = None) -> int:
        """Fill ``out`` (the box of ``key`` starting at ``offsets``) from the chunks it overlaps (``opened``: chunks
        already opened by ``chunk``); returns bytes copied. Raises if the chunks leave part of the box uncovered."""
        done = 0
        for c in self.overlapping(key, offsets, out.shape):
            lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
            hi = [min(o + n, co + cn) for o, n, co, cn in zip(offsets, out.shape, c.offsets, c.sizes)]
            src = opened[c] if opened is not None and c in opened else self.chunk(key, c)
            dst = out
            for d, (l, h) in enumerate(zip(lo, hi)):
                src = src.narrow(d, l - c.offsets[d], h - l)
                dst = dst.narrow(d, l - offsets[d], h - l)
            dst.copy_(src)
            done += dst.numel()
        if done != out.numel():
            raise CorruptCheckpointError(f"{self.folder}: key {key!r}: the saved chunks cover {done} of the "
                                         f"{out.numel()} elements asked for; the DCP checkpoint is incomplete")
        return done * out.element_size()


def _bounded(stream: Any, limit: int, what: str) -> io.BytesIO:
    """At most ``limit`` bytes of ``stream`` in memory (one more is a CorruptCheckpointError: a blob that decodes
    to more than its tensor or value can hold)."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{what}: decodes to more than {limit} bytes, more than it can hold; crafted "
                                     "or damaged")
    return io.BytesIO(data)


def value_parts(saved: Iterable[str], key: str) -> list[str]:
    """The saved keys that hold the plain value ``key``: ``[key]``, or the leaves DCP split a nested value into
    (``key.lr``, ``key.milestones``: DCP flattens every dict; liferaft keeps a container of plain values whole)."""
    saved = list(saved)
    return [key] if key in saved else [k for k in saved if k.startswith(key + ".")]


def joined_value(key: str, parts: list[str], get: Callable[[str], Any],
                 paths: Mapping[str, tuple[Any, ...]] | None = None) -> Any:
    """The plain value ``key`` from its ``value_parts``: the value itself, or its leaves nested again (by the
    recorded ``paths`` where given, else by the dots of the keys)."""
    if parts == [key]:
        return get(key)
    paths = paths or {}
    depth = len(paths.get(key, tuple(key.split("."))))
    return nest({tuple(paths.get(k, tuple(k.split("."))))[depth:]: get(k) for k in parts})


class DcpReader(Reader):
    """A DCP checkpoint folder (``DcpCheckpoint``) as a :class:`Reader`: keys are DCP's flattened names; plain
    values that DCP split into several keys (nested dicts) are rebuilt with ``value_parts``/``joined_value``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        ck = self.ck = DcpCheckpoint(path)
        super().__init__(url=ck.folder, fmt="dcp", tensors={
            k: TensorSpec(key=k, dtype=dtype_name(t.dtype), shape=t.shape, path=ck.paths.get(k),
                          boxes=tuple((c.offsets, c.sizes) for c in t.chunks), nbytes=t.nbytes)
            for k, t in ck.tensors.items()}, values={k: ValueSpec(key=k, path=ck.paths.get(k)) for k in ck.values})

    def value(self, key: str) -> Any:
        return self.ck.value(key)

    def value_parts(self, key: str) -> list[str]:
        return [] if key in self.ck.values else value_parts(self.ck.values, key)

    def joined_value(self, key: str, parts: Sequence[str]) -> Any:
        return joined_value(key, list(parts), self.ck.value, self.ck.paths)

    def copy_box(self, key: str, offsets: Sequence[int], out: torch.Tensor) -> int:
        return self.ck.copy_box(key, offsets, out)

    def plan(self, requests: Sequence[BoxRead]) -> ReadJob:
        return _DcpJob(self, requests)

    def tree(self, leaves: Mapping[str, Any]) -> Any:
        return nest({tuple(self.ck.paths.get(k, tuple(k.split(".")))): v for k, v in leaves.items()})

    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        """Every data file the metadata names exists and is long enough, and every blob (one ``torch.save``
        archive per chunk and per value) is read with its records' zip CRC-32 checked; blobs stored through a DCP
        extension are read through it (and listed as unchecked)."""
        ck, p = self.ck, self.ck.folder
        records = crc_bytes = nbytes = no_crc = 0
        faults: list[str] = []
        unchecked: list[str] = []
        blobs: dict[tuple[str, int, int], tuple[str, str, tuple[str, ...]]] = {}
        for key, t in ck.tensors.items():
            for c in t.chunks:
                blobs.setdefault((c.file, c.offset, c.length), (key, f"chunk at {list(c.offsets)}", c.transforms))
        for key, info in ck.values.items():
            file = ck._inside(info.relative_path, key)
            blobs.setdefault((file, int(info.offset), int(info.length)),
                             (key, "value", tuple(getattr(info, "transform_descriptors", None) or ())))
        sizes: dict[str, int | None] = {}
        for (file, offset, length), (key, part, transforms) in blobs.items():
            name = os.path.relpath(file, p)
            if file not in sizes:
                sizes[file] = os.path.getsize(file) if os.path.isfile(file) else None
                if sizes[file] is None:
                    faults.append(f"data file {name!r} is missing")
            if sizes[file] is None:
                continue
            what = f"file {name!r} (key {key!r}, {part}, bytes {offset}..{offset + length})"
            if offset + length > sizes[file]:
                faults.append(f"{what}: the file has {sizes[file]} bytes; truncated")
                continue
            if transforms:                          # a DCP extension (zstd, ...): read through DCP's transforms
                try:
                    if part == "value":
                        ck.value(key)
                    else:
                        ck.chunk(key, next(c for c in ck.tensors[key].chunks if c.file == file and
                                           c.offset == offset))
                    nbytes += length
                    unchecked.append(f"{key} ({part}: stored through {'+'.join(transforms)})")
                except Exception as e:  # noqa: BLE001 - any failure of the extension is a fault of this blob
                    faults.append(f"{what}: cannot be read ({e})")
                continue
            with ck.open_file(file, f"data file {name!r}") as f:
                r, cb, n, fs, nc = check_zip(io.BufferedReader(View(f, offset, length)), what, progress)
            if part != "value" and not fs:          # the blob's header: the dtype, shape and layout recorded
                try:
                    ck.chunk(key, next(c for c in ck.tensors[key].chunks if c.file == file and c.offset == offset))
                except LiferaftError as e:
                    fs = [f"{what}: {e}"]
            records, crc_bytes, nbytes, no_crc = records + r, crc_bytes + cb, nbytes + n, no_crc + nc
            faults += fs
        if no_crc:
            unchecked.append(f"{no_crc} zip record(s) written without a CRC-32 (torch.save with compute_crc32 off)")
        return CheckReport(path=p, fmt=self.fmt, units=records, checked_bytes=crc_bytes, bytes_read=nbytes,
                           unchecked=tuple(unchecked), faults=tuple(faults))


class _DcpJob(ReadJob):
    """Reads from a DCP checkpoint: every chunk the requests overlap is opened while planning — its blob present
    and long enough, its header a ``torch.save`` tensor of the recorded dtype and shape, the data memory-mapped
    (nothing read yet) — so that a damaged checkpoint is refused before any byte of the state changes; ``run``
    copies from those views. (Chunks stored through a DCP extension are decoded whole when copied; their blobs are
    checked present here.)"""

    def __init__(self, reader: DcpReader, requests: Sequence[BoxRead]) -> None:
        super().__init__(reader, requests)
        self.ck = reader.ck
        self.opened: dict[DcpChunk, torch.Tensor] = {}
        for key, (offsets, sizes), _ in self.requests:
            for c in self.ck.overlapping(key, offsets, sizes):
                if c in self.opened:
                    continue
                if c.transforms:
                    self.ck._blob(c, key).close()
                else:
                    self.opened[c] = self.ck.chunk(key, c)

    def run(self, *, check_only: bool = False, peers: Any = None, rank: int = 0,
            sharing: Mapping[Any, Any] | None = None, host: Any = None) -> ReadOutcome:
        out = ReadOutcome()
        if check_only:
            return out
        with torch.no_grad():
            for key, (offsets, _), dest in self.requests:
                out.used += self.ck.copy_box(key, offsets, dest, self.opened)
        return out
