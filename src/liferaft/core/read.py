"""The one-process tools, for a checkpoint in any format (``core.open.open_reader``): read, inspect, verify."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from liferaft.core.native import NativeReader
from liferaft.core.open import format_of, open_reader
from liferaft.core.process import in_call
from liferaft.errors import CorruptCheckpointError, StateMismatchError
from liferaft.formats.base import CheckReport, select
from liferaft.options import MAX_READ_BYTES, MIN_READ_BYTES, LoadOptions, check_int, check_path
from liferaft.state.dtypes import torch_dtype
from liferaft.state.values import as_leaf, per_rank_leaf


@in_call
def read(path: str | os.PathLike[str], keys: Sequence[str] | None = None, *,
         options: LoadOptions | None = None) -> Any:
    """Read a checkpoint of any format in one process, without a template: full tensors, in the saved nesting
    (a flat dict for formats that record none, like safetensors).

    ``keys`` selects keys (``formats.base.select``: a key, every key under a prefix — ``"model"`` selects
    ``model.*`` —, or a glob); a pattern that selects nothing raises StateMismatchError. Stateful objects come back
    as their state dicts; numpy arrays and bytes as such; a value that differed per saving rank as a
    :class:`PerRank` tuple. liferaft's bytes are verified; the other formats carry no checksums.
    """
    reader = open_reader(path, options, lazy=True)     # (chunk tables: only those of the keys read)
    try:
        chosen = set(select(reader.keys, keys, url=reader.url, error=StateMismatchError))
        specs = [t for k, t in reader.tensors.items() if k in chosen]
        reader.check_present([t.key for t in specs])        # (sizes the manifest claims hold, before allocating)
        targets = [torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for t in specs]
        reader.plan([(t.key, (tuple(0 for _ in t.shape), t.shape), out) for t, out in zip(specs, targets)]).run()
        world = reader.world_size or 1
        leaves: dict[str, Any] = {
            t.key: per_rank_leaf(t.kind, t.per_rank, out, world) if t.per_rank is not None else as_leaf(t.kind, out)
            for t, out in zip(specs, targets)}
        for k in reader.values:
            if k in chosen:
                leaves[k] = reader.value(k)
        return reader.tree({k: leaves[k] for k in reader.keys if k in leaves})
    finally:
        reader.close()


@dataclass(frozen=True)
class ContainerInfo:
    """A dict, list, tuple or stateful object of the saved nesting: its path, kind, children in saved order (None:
    not recorded) and, for a stateful object, its class."""

    path: tuple[str | int, ...]
    kind: str
    children: tuple[str | int, ...] | None = None
    cls: str | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One saved tensor: key, what it was in the state (``kind``), dtype, shape, bytes and chunks saved."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of a checkpoint (from its metadata only). For formats other than liferaft (``format``) the fields
    they do not record are empty (``format_version`` 0, no save id, versions or files)."""

    path: str
    format_version: int
    save_id: str
    world_size: int
    created_unix: float
    liferaft_version: str
    torch_version: str
    tensors: tuple[TensorInfo, ...]
    values: tuple[str, ...]
    files: Mapping[str, int]
    metadata: Mapping[str, Any]
    format: str = "liferaft"
    #: each key's place in the saved nesting (a dotted key split, for formats that record none)
    paths: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    #: the containers liferaft recorded (empty for other formats)
    containers: tuple[ContainerInfo, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def __str__(self) -> str:
        head = (f"checkpoint {self.path}: format v{self.format_version}, written by {self.world_size} rank(s), "
                f"liferaft {self.liferaft_version}, torch {self.torch_version}") if self.format == "liferaft" else \
            f"{self.format} checkpoint {self.path}"
        size = f"{self.total_bytes / 2**20:.1f} MiB" if self.files else \
            f"{sum(t.nbytes for t in self.tensors) / 2**20:.1f} MiB of tensors"
        lines = [head,
                 f"{len(self.tensors)} tensors, {len(self.values)} values, {len(self.files)} data files, {size}"]
        for t in self.tensors:
            lines.append(f"  {t.key:<50} {t.dtype:<9} {list(t.shape)!s:<20} {t.chunks:>4} chunk(s) "
                         f"{t.nbytes / 2**20:10.3f} MiB")
        for v in self.values:
            lines.append(f"  {v:<50} value")
        return "\n".join(lines)


@in_call
def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Summary of the checkpoint at ``path``, in any format: keys, shapes, dtypes, chunks and bytes (from its
    metadata only: no tensor data is read)."""
    reader = open_reader(path, lazy=True)      # (a version 4 checkpoint's tables streamed: chunks counted, not kept)
    try:
        info = reader.info
        counts: dict[str, int] | None = None
        if isinstance(reader, NativeReader) and reader.streams:     # (counted, one table at a time)
            counts = dict.fromkeys(reader.tensors, 0)
            for key, _ in reader.stream_chunks(reader.tensors):
                counts[key] += 1
        return CheckpointInfo(
            path=reader.url, format_version=info.get("format_version", 0), save_id=info.get("save_id", ""),
            world_size=reader.world_size or 0, created_unix=info.get("created_unix", 0.0),
            liferaft_version=info.get("liferaft_version", ""), torch_version=info.get("torch_version", ""),
            tensors=tuple(TensorInfo(t.key, t.kind, t.dtype, t.shape, t.nbytes,
                                     len(t.boxes) if counts is None else counts[t.key])
                          for t in reader.tensors.values()),
            values=tuple(reader.values), files=dict(info.get("files", {})), metadata=dict(info.get("metadata", {})),
            format=reader.fmt, paths={k: tuple(s.path) if s.path is not None else tuple(k.split("."))
                                      for k, s in [*reader.tensors.items(), *reader.values.items()]},
            containers=tuple(ContainerInfo(*c) for c in info.get("containers", ())))
    finally:
        reader.close()


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked: ``chunks`` units (liferaft's chunks; zip records of the other formats) holding
    ``bytes_checked`` bytes checked against checksums, and what carried nothing to check against (``unchecked``)."""

    path: str
    chunks: int
    bytes_checked: int
    format: str = "liferaft"
    bytes_read: int = 0
    unchecked: tuple[str, ...] = ()


@in_call
def check(path: str | os.PathLike[str], *, max_read_bytes: int | None = None,
          progress: Callable[[int], None] | None = None) -> CheckReport:
    """What ``verify`` checks, reported instead of raised: every fault found, and what could not be checked. A
    safetensors file whose header is damaged is a fault of the report (its folder's index must be usable)."""
    check_path(path, "verify(path=...)")
    check_int("verify", "max_read_bytes", max_read_bytes, MIN_READ_BYTES, MAX_READ_BYTES, none=True)
    if format_of(path) == "safetensors":         # each file's damage is a fault, not a refusal to look
        from liferaft.formats.safetensors import verify_files

        return verify_files(os.fspath(path), progress)
    reader = open_reader(path, LoadOptions(max_read_bytes=max_read_bytes), lazy=True)    # (tables streamed)
    try:
        return reader.verify(progress)
    finally:
        reader.close()


def verify(path: str | os.PathLike[str], *, max_read_bytes: int | None = None,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Read and check the checkpoint at ``path`` as far as its format allows; raise CorruptCheckpointError listing
    every fault found. A liferaft checkpoint: every data file present with its recorded size and every block of
    every chunk re-hashed. A DCP folder or ``torch.save`` file: every zip record's CRC-32. safetensors: the header
    and layout checked and every byte read (they carry no checksums). ``progress`` is called with the bytes of
    each read (for a progress bar). ``max_read_bytes``: the largest read (None: the storage's ``read_size``)."""
    report = check(path, max_read_bytes=max_read_bytes, progress=progress)
    if report.faults:
        shown = "\n  ".join(report.faults[:20])
        more = f"\n  ... and {len(report.faults) - 20} more" if len(report.faults) > 20 else ""
        raise CorruptCheckpointError(f"{report.path}: verify found {len(report.faults)} fault(s):\n  {shown}{more}")
    return VerifyReport(path=report.path, chunks=report.units, bytes_checked=report.checked_bytes,
                        format=report.fmt, bytes_read=report.bytes_read, unchecked=report.unchecked)
