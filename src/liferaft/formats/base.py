"""The reader protocol every on-disk format implements, so that one load pipeline and every tool take them all.

A :class:`Reader` is a checkpoint opened for reading, in any format: its tensors (:class:`TensorSpec`: dtype, shape,
kind, the boxes it was saved in) and plain values (:class:`ValueSpec`) by key; ``plan(requests)`` turns "copy this
box of this key into this tensor" requests into a :class:`ReadJob` that ``run()`` executes (the native reader
coalesces, shares and verifies the reads; the others copy from memory-mapped files); ``value(key)`` decodes a plain
value (never running code from the checkpoint); ``tree(leaves)`` nests leaves in the saved structure;
``verify()`` checks what the format lets be checked. ``verified`` says whether the bytes read are checked against
checksums (only liferaft's are). Readers are opened by ``liferaft.core.open.open_reader`` after
``formats.detect.detect`` says what a path holds.
"""

from __future__ import annotations

import fnmatch
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from liferaft.errors import LiferaftError, OptionsError, StateMismatchError
from liferaft.state.dtypes import torch_dtype

Box = tuple[tuple[int, ...], tuple[int, ...]]        # (offsets, sizes) within the global tensor
PathPart = str | int
#: A request to read: (key, box of the saved tensor, destination tensor of the box's shape).
BoxRead = tuple[str, Box, torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """One saved tensor. ``shape`` is as stored (for a tensor stored ``per_rank``, the leading dimension is the
    saving ranks'); ``kind`` is what it was in the state ("tensor", "numpy", "bytes"); ``boxes`` the saved chunks;
    ``nbytes`` its stored bytes; ``path`` the nesting recorded for it (None when the format records none)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "tensor"
    path: tuple[PathPart, ...] | None = None
    per_rank: tuple[int, ...] | None = None
    lossy: Mapping[str, Any] | None = None
    boxes: tuple[Box, ...] = ()
    nbytes: int = 0

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape each rank held: ``shape`` less the ranks' dimension of a tensor stored per rank."""
        return self.shape[1:] if self.per_rank is not None else self.shape


@dataclass(frozen=True)
class ChunkInfo:
    """How one saved chunk of a tensor is stored (``Reader.chunks``): its box in the global tensor, the file that
    holds it, the codecs its bytes went through (``("raw",)`` for none; liferaft's XOR deltas show as
    ``"xor-delta"``, DCP's stream transforms joined by ``+``), the bytes it takes there, the rank that wrote it
    (None when the format does not say), and whether it lies in another checkpoint (``referenced``: an incremental
    liferaft save pointing at a sibling's bytes instead of storing them again)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    codecs: tuple[str, ...] = ("raw",)
    stored_bytes: int = 0
    rank: int | None = None
    referenced: bool = False


@dataclass(frozen=True)
class ValueSpec:
    """One saved plain value; ``per_rank``: it differed between the saving ranks (it decodes to a ``PerRank``)."""

    key: str
    path: tuple[PathPart, ...] | None = None
    per_rank: bool = False


@dataclass
class ReadOutcome:
    """What a :class:`ReadJob` moved: bytes copied into the destinations, bytes received from peers, seconds spent
    verifying (overlapped with the reads)."""

    used: int = 0
    received: int = 0
    verify_s: float = 0.0


class ReadJob:
    """Planned reads of boxes into destination tensors. ``spans``: byte ranges of files that several ranks may
    read (the native reader) for ``planning.share_plan``, with ``span_bytes`` (each span's bytes once decoded);
    ``host``: the same-host shared-memory segments of ``core.chunks.shm``; ``run`` copies (``check_only``: reads and
    verifies without copying, for formats that verify). This default copies each request with the reader's
    ``copy_box``."""

    def __init__(self, reader: Reader, requests: Sequence[BoxRead]) -> None:
        self.reader, self.requests = reader, list(requests)
        self.spans: list[tuple[str, int, int]] = []
        self.span_bytes: dict[tuple[str, int, int], int] = {}     # per span, its bytes once decoded

    def run(self, *, check_only: bool = False, peers: Any = None, rank: int = 0,
            sharing: Mapping[Any, Any] | None = None, host: Any = None) -> ReadOutcome:
        out = ReadOutcome()
        if check_only:
            return out                                  # nothing to verify against: the copy is the read
        with torch.no_grad():
            for key, (offsets, _), dest in self.requests:
                out.used += self.reader.copy_box(key, offsets, dest)
        return out


@dataclass(frozen=True)
class CheckReport:
    """What ``Reader.verify`` checked: ``units`` checked (chunks, zip records, files) holding ``checked_bytes``,
    ``bytes_read`` in all, what carried nothing to check against (``unchecked``) and every fault found."""

    path: str
    fmt: str
    units: int
    checked_bytes: int
    bytes_read: int
    unchecked: tuple[str, ...] = ()
    faults: tuple[str, ...] = ()


@dataclass
class Reader(ABC):
    """A checkpoint in some format, opened for reading (see the module doc). Subclasses fill the fields and
    implement ``value``, ``copy_box`` (or ``plan``) and ``verify``."""

    url: str
    fmt: str
    tensors: dict[str, TensorSpec]
    values: dict[str, ValueSpec]
    verified: bool = False
    world_size: int | None = None
    #: the classes recorded for stateful containers, by path (``state.matching`` rule 1)
    classes: Mapping[tuple[PathPart, ...], str | None] = field(default_factory=dict)
    #: what the format records about the checkpoint (version, save id, writer versions, files, metadata)
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        """Every key: the tensors', then the values'."""
        return [*self.tensors, *self.values]

    @abstractmethod
    def value(self, key: str) -> Any:
        """The plain value ``key``, decoded (no code from the checkpoint runs)."""

    def value_parts(self, key: str) -> list[str]:
        """The saved keys holding the plain value ``key`` when the format split it into several (DCP flattens
        nested dicts); [] when it did not."""
        return []

    def joined_value(self, key: str, parts: Sequence[str]) -> Any:
        """The plain value ``key`` rebuilt from its ``value_parts``."""
        raise StateMismatchError(f"{self.url}: {key!r} is not a value of this checkpoint")

    def copy_box(self, key: str, offsets: Sequence[int], out: torch.Tensor) -> int:
        """Fill ``out`` with the box of ``key`` that starts at ``offsets``; the bytes copied."""
        raise NotImplementedError

    def plan(self, requests: Sequence[BoxRead]) -> ReadJob:
        """A job that reads each requested box into its destination; checks that need no data (files present and
        long enough) run here, before anything is copied."""
        return ReadJob(self, requests)

    def read_box(self, key: str, box: Box) -> torch.Tensor:
        """The values of one box of ``key`` as a new tensor."""
        out = torch.empty(box[1], dtype=torch_dtype(self.tensors[key].dtype))
        self.plan([(key, box, out)]).run()
        return out

    def chunk_infos(self, keys: Iterable[str]) -> Iterator[tuple[str, ChunkInfo]]:
        """Every chunk of the tensors ``keys`` (``chunks``), each with its key, the keys in turn. A reader whose
        chunk records come in pieces (liferaft's chunk tables, opened ``lazy``) streams them instead, one piece
        in memory at a time, keeping none: the order is then the pieces'."""
        for key in keys:
            for c in self.chunks(key):
                yield key, c

    def chunks(self, key: str) -> tuple[ChunkInfo, ...]:
        """How the tensor ``key`` is stored, chunk by chunk (``describe``). This default: one raw chunk per saved
        box (the whole tensor when the format records none) in the checkpoint's own file, its logical bytes
        stored, no writer known; readers that know more (liferaft's: codecs, files, writing ranks, references)
        say so."""
        spec = self.tensors[key]
        itemsize = torch.empty(0, dtype=torch_dtype(spec.dtype)).element_size()
        boxes = spec.boxes or ((tuple(0 for _ in spec.shape), tuple(spec.shape)),)
        return tuple(ChunkInfo(offsets=tuple(o), sizes=tuple(s), file=self.url, stored_bytes=math.prod(s) * itemsize)
                     for o, s in boxes)

    def read_order(self, keys: Sequence[str], window_chunks: int | None = None) -> bool:
        """The tools will read the tensors ``keys`` in this order (each whole or in slabs): a reader that holds
        per-chunk records it reads on demand (liferaft's chunk tables) may then keep those of a window of keys at
        a time (about ``window_chunks`` records). Returns whether it does: reads in another order then cost more.
        This default holds nothing per chunk: False."""
        return False

    def check_present(self, keys: Iterable[str]) -> None:
        """Raise CorruptCheckpointError when data that reading the tensors ``keys`` needs is missing or shorter
        than recorded — the checks ``plan`` makes before copying, made up front (an export calls it once, before
        it writes anything). A reader checks each file once: the ``plan`` of every later read skips it. This
        default has nothing to check (the formats whose files are mapped when opened)."""

    def tree(self, leaves: Mapping[str, Any]) -> Any:
        """``leaves`` (values by key) nested as the checkpoint recorded them; a flat dict when it records no
        nesting."""
        return dict(leaves)

    @abstractmethod
    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        """Read and check everything the format allows; faults are reported, not raised."""

    def close(self) -> None:
        """Release what the reader holds (mappings, descriptors)."""


def copy_from(full: torch.Tensor, offsets: Sequence[int], out: torch.Tensor) -> int:
    """Copy the box of ``full`` that starts at ``offsets`` and has ``out``'s shape into ``out``; the bytes copied
    (the readers whose tensors are whole in memory or mapped: safetensors, torch.save)."""
    view = full
    for d, (o, n) in enumerate(zip(offsets, out.shape)):
        view = view.narrow(d, o, n)
    out.copy_(view)
    return out.numel() * out.element_size()


def check_patterns(patterns: Any) -> tuple[str, ...]:
    """``keys=`` as given by a caller, checked: None or a list/tuple of non-empty strings (a bare string is refused:
    it would be read as one pattern per character). OptionsError otherwise."""
    if patterns is None:
        return ()
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, (list, tuple)):
        raise OptionsError(f"keys must be a list of key patterns, got {type(patterns).__name__} {patterns!r:.80}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise OptionsError(f"key pattern {p!r:.80} is not a non-empty string")
    return tuple(patterns)


def matches(key: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``patterns`` select ``key`` (the rule of :func:`select`); every key when there are none."""
    return not patterns or any(key == p or key.startswith(p + ".") or fnmatch.fnmatchcase(key, p) for p in patterns)


def select(keys: Sequence[str], patterns: Sequence[str] | None, *, url: str = "", required: bool = True,
           error: type[LiferaftError] = OptionsError) -> list[str]:
    """The keys that ``patterns`` select — the one meaning of ``keys=`` everywhere: a pattern selects a key equal
    to it, every key under it (``"model"`` selects ``model.*``), or every key it matches as a glob (``*``, ``?``,
    ``[...]``). None or empty selects every key. With ``required`` a pattern that selects nothing raises ``error``
    naming it."""
    if not check_patterns(patterns):
        return list(keys)
    chosen: set[str] = set()
    for p in patterns:
        hit = {k for k in keys if matches(k, (p,))}
        if not hit and required:
            raise error(f"{url + ': ' if url else ''}key {p!r} is not in the checkpoint (no key equals it, "
                               "lies under it or matches it as a glob)")
        chosen |= hit
    return [k for k in keys if k in chosen]
