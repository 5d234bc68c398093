"""A checkpoint of any format as the tools' flat view (``Source``): tensors by key as (dtype name, shape, kind)
read by boxes on demand, plain values decoded when called, each tensor's saved boxes and the recorded nesting;
built on the one reader protocol (``formats.base.Reader``, opened by ``core.open.open_reader``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from liferaft.core.open import open_reader
from liferaft.formats.base import CheckReport, Reader, matches
from liferaft.formats.dcp import DcpReader
from liferaft.formats.detect import NAMES, detect  # noqa: F401  (the tools' detector)
from liferaft.options import LoadOptions


@dataclass
class Source:
    """A checkpoint in any format, read on demand: tensors by key as (dtype name, shape, kind), ``read(key, box)``
    for the values of one box ``(offsets, sizes)`` of a tensor, the plain values by key (decoded when called),
    and for DCP each tensor's saved chunks and the nesting DCP recorded per key."""

    url: str
    fmt: str
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    read: Callable[[str, Any], torch.Tensor]
    values: dict[str, Callable[[], Any]]
    chunks: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    reader: Reader | None = None

    def renamed(self, rename: Callable[[str], str]) -> "Source":
        """The same checkpoint with every key renamed by ``rename`` (two keys to one name: OptionsError)."""
        from liferaft.errors import OptionsError

        old = {rename(k): k for k in [*self.tensors, *self.values]}
        if len(old) != len(self.tensors) + len(self.values):
            raise OptionsError(f"{self.url}: the renaming maps two keys to one name")
        read = self.read
        return Source(self.url, self.fmt, {rename(k): v for k, v in self.tensors.items()},
                      lambda k, box: read(old[k], box), {rename(k): v for k, v in self.values.items()},
                      {rename(k): v for k, v in self.chunks.items()})      # (the recorded nesting no longer fits)

    def selected(self, keys: Sequence[str] | None) -> "Source":
        """Only the keys ``keys`` select (``formats.base.matches``: a key, a prefix or a glob; all for None)."""
        if not keys:
            return self

        def keep(k: str) -> bool:
            return matches(k, keys)
        return Source(self.url, self.fmt, {k: v for k, v in self.tensors.items() if keep(k)}, self.read,
                      {k: v for k, v in self.values.items() if keep(k)}, self.chunks, self.paths, self.reader)


def open_source(path: str | os.PathLike[str], keys: Sequence[str] | None = None,
                options: LoadOptions | None = None) -> Source:
    """The tensors and values of a checkpoint in any format (``keys``: keys, prefixes or globs to keep, ``formats.base.matches``), read on demand: liferaft's
    verified like any load, the others as they are (memory-mapped)."""
    r = open_reader(path, options)
    picked = (lambda k: matches(k, keys))
    return Source(r.url, r.fmt, {k: (t.dtype, tuple(t.shape), t.kind) for k, t in r.tensors.items() if picked(k)},
                  r.read_box, {k: (lambda k=k: r.value(k)) for k in r.values if picked(k)},
                  {k: t.chunks for k, t in r.ck.tensors.items()} if isinstance(r, DcpReader) else {},
                  {k: tuple(s.path) for k, s in [*r.tensors.items(), *r.values.items()] if s.path is not None}, r)


def check_source(path: str | os.PathLike[str], progress: Callable[[int], None] | None = None) -> CheckReport:
    """``verify`` of a checkpoint in any format, faults reported, not raised (``core.read.check``)."""
    from liferaft.core.read import check

    return check(path, progress=progress)


def _dt(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")
