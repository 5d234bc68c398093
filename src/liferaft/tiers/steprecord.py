"""One step record of the per-step log (docs/STEPLOG.md): its bytes, and reading them back as hostile input.

A record is one slot file ``<memory tier base>/<job>/<node>/steplog/<owner>/r<rank, 5 digits>/slot-<i, 4 digits>``
(``<owner>``: ``tiers.stepcheck.owner_id`` of the manager's root):

- bytes 0..63, the prologue: ``MAGIC`` (8 bytes), then little-endian u64s: the record's length, the header's
  offset and length, then the header's xxh3_64 digest (16 hex digits, ASCII); the rest zero. Written last: a record
  being written has a zeroed prologue and is no record.
- from byte 64: the tensors (gradients, tensor hyperparameters and keyword arguments, the rest of the state's
  tensors), raw, each at the offset its header entry names.
- the header: strict JSON (``format/jsonsafe``) — ``format``, ``checksum`` (the tensors' algorithm, one of
  ``format.records.CHECKSUM_ALGOS``), ``step``, ``rank``, ``world``, ``owner`` (the namespace's owner id),
  ``layout`` (the fingerprint of ``state.optsteps.layout_of``), ``calls`` (per ``optimizer.step()``: ``opt``
  index, ``grads`` (a tensor entry or null each), ``groups`` (hyperparameters per group, tagged values of
  ``state.values``; a tensor as ``{"$t": entry}``), ``kwargs``, and ``attrs`` when GradScaler set
  ``state.optsteps.AMP_ATTRS`` on the optimizer), ``rest`` (``tensors``: key → tensor entries, one per local part;
  ``values``: key → tagged value). A tensor entry is ``{"off", "len", "dtype", "shape", "digest"}``. Records are
  written with ``RECORD_CHECKSUM`` (XXH3-64: four times CRC-32C's speed here, computed on the training thread
  anyway, and 64 bits, so replication decides "the peer holds these bytes" on the record's own digests); any of
  ``CHECKSUM_ALGOS`` reads.
- a replica kept by a peer whose own record of the same step holds some of the gradients (DDP: all of them) may
  leave those byte ranges unwritten and say so in a *held trailer* at byte ``length`` (past the record): ``HELD``
  (8 bytes), little-endian u64s step, source rank, holder rank, the holder's own slot and the number of runs, then
  per run the offset in the holder's own record, the offset in this record and the length, then the XXH3-64 (16
  hex digits) of all that. Reading such a replica fills the runs from the holder's record of that step in the
  same node's folder of the holder (checked: its step and rank, a whole record, every run inside both records)
  and then verifies every tensor as for any record. A replica written whole has the trailer's magic zeroed.

Reading checks every size against the file and the caps below before allocating, every tensor's digest, and the
header's; any mismatch raises CorruptCheckpointError naming the file — never a wrong step.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from liferaft.codecs.checksum import digest
from liferaft.errors import CorruptCheckpointError
from liferaft.format.jsonsafe import loads
from liferaft.format.limits import MAX_INT, MAX_NDIM, MAX_WORLD_SIZE
from liferaft.format.records import CHECKSUM_ALGOS
from liferaft.state.dtypes import dtype_name
from liferaft.storage.files import open_read

MAGIC = b"LRSTEP01"
HELD = b"LRHELD01"
RECORD_CHECKSUM = "xxh3_64"
MAX_HELD_RUNS = 1 << 20
_HELD_HEAD = struct.Struct("<8sQQQQQ")
_RUN = struct.Struct("<QQQ")
_HELD_DIGEST = 16
FORMAT = "liferaft-steplog/1"
PROLOGUE = 64
MAX_HEADER_BYTES = 256 << 20
MAX_RECORD_BYTES = 1 << 40
_DTYPES = {dtype_name(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                      torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                      torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}


def prologue(length: int, header_off: int, header_len: int, header_digest: str) -> bytes:
    out = MAGIC + struct.pack("<QQQ", length, header_off, header_len) + header_digest.encode("ascii")
    return out + bytes(PROLOGUE - len(out))


def encode_header(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()


def tensor_entry(off: int, t: torch.Tensor, data: memoryview) -> dict[str, Any]:
    """The header entry of tensor ``t`` stored at ``off`` as ``data`` (its bytes; checksum ``RECORD_CHECKSUM``,
    which the header names as ``checksum``)."""
    return entry_of(off, t, len(data), digest(data, RECORD_CHECKSUM))


def entry_of(off: int, t: torch.Tensor, n: int, hexdigest: str) -> dict[str, Any]:
    """The header entry of tensor ``t`` stored at ``off`` as ``n`` bytes whose ``RECORD_CHECKSUM`` is
    ``hexdigest``."""
    return {"off": off, "len": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "digest": hexdigest}


@dataclass(frozen=True)
class Held:
    """A replica's held trailer, as read and checked: the byte ``runs`` (offset in rank ``holder``'s own record of
    ``step``, in its slot ``own_slot``; offset in the replica; length) to fill from there."""

    step: int
    source: int
    holder: int
    own_slot: int
    runs: list[tuple[int, int, int]]


def held_trailer(step: int, source: int, holder: int, own_slot: int, runs: list[tuple[int, int, int]]) -> bytes:
    """The held trailer of a replica of ``source``'s record of ``step`` whose ``runs`` are in rank ``holder``'s own
    record in ``own_slot`` (written at the replica's byte ``length``, before its prologue)."""
    body = _HELD_HEAD.pack(HELD, step, source, holder, own_slot, len(runs)) + \
        b"".join(_RUN.pack(*r) for r in runs)
    return body + digest(body, "xxh3_64").encode("ascii")


def held_size(runs: int) -> int:
    """Bytes of a held trailer of ``runs`` runs."""
    return _HELD_HEAD.size + runs * _RUN.size + _HELD_DIGEST


def read_held(root: str, rel: str, length: int) -> Held | None:
    """The held trailer past the ``length`` bytes of the replica ``root/rel``; None for a replica written whole.
    Hostile input: the run count is checked against the file before it is read, the digest, and every run inside
    the record past its prologue, in order and disjoint (CorruptCheckpointError naming the file otherwise)."""
    path = os.path.join(root, rel)
    fd = open_read(root, rel, limit=MAX_RECORD_BYTES)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HELD_HEAD.size, length) if size >= length + _HELD_HEAD.size else b""
        if head[:8] != HELD:
            return None
        _, step, source, holder, own_slot, n = _HELD_HEAD.unpack(head)
        if n > MAX_HELD_RUNS or length + held_size(n) > size:
            raise _fail(path, f"has a held trailer of {n} runs that does not fit the file")
        rest = os.pread(fd, n * _RUN.size + _HELD_DIGEST, length + _HELD_HEAD.size)
    finally:
        os.close(fd)
    body = head + rest[:n * _RUN.size]
    if len(rest) != n * _RUN.size + _HELD_DIGEST or digest(body, "xxh3_64").encode("ascii") != rest[-_HELD_DIGEST:]:
        raise _fail(path, "held trailer does not match its checksum (torn or damaged)")
    runs = [_RUN.unpack_from(rest, i * _RUN.size) for i in range(n)]
    pos = PROLOGUE
    for _, dst, k in runs:
        if k <= 0 or dst < pos or dst + k > length:
            raise _fail(path, f"held trailer names bytes [{dst}, {dst + k}) outside the record's {length} bytes "
                              "or out of order")
        pos = dst + k
    return Held(step, source, holder, own_slot, runs)


def held_home(root: str, rel: str, held: Held, mine: bytearray | None) -> bytearray | None:
    """The whole record of ``held.step`` by rank ``held.holder`` in the slot file ``root/rel`` (``mine``: those
    bytes, read and verified already), or None if the slot holds no such record (reused since: the replica is
    stale) or holds a replica with held runs itself (never chained). Every run is checked inside it first
    (CorruptCheckpointError naming the file)."""
    data = mine
    if data is None:
        h = read_header(root, rel) if os.path.exists(os.path.join(root, rel)) else None
        if h is None or h.step != held.step or h.doc["rank"] != held.holder or \
                read_held(root, rel, h.length) is not None:
            return None
        data = read_record(root, rel, h.length)
    for s, _, k in held.runs:
        if s < PROLOGUE or s + k > len(data):
            raise _fail(os.path.join(root, rel), f"is named by a held trailer for bytes [{s}, {s + k}), outside "
                                                 f"its {len(data)} bytes")
    return data


def fill_held(data: bytearray, held: Held, own: bytes | bytearray | memoryview, path: str) -> None:
    """Copy ``held``'s runs from the holder's own record ``own`` into the replica's bytes ``data`` (every run
    checked inside both first; the result is verified by the caller as any record)."""
    src = memoryview(own)
    for s, d, k in held.runs:
        if s < PROLOGUE or s + k > len(src) or d + k > len(data):
            raise _fail(path, f"held trailer names bytes [{s}, {s + k}) outside the holder's own record of "
                              f"{len(src)} bytes")
    for s, d, k in held.runs:
        data[d:d + k] = src[s:s + k]


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (any dtype)."""
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


@dataclass
class Header:
    """A record's header, as read and checked (``path`` names the file in messages)."""

    path: str
    length: int
    header_off: int
    doc: dict[str, Any]

    @property
    def step(self) -> int:
        return self.doc["step"]

    @property
    def algo(self) -> str:
        """The checksum algorithm of the record's tensors."""
        return self.doc["checksum"]


def _fail(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: step record {what}; the per-step log stops before this record "
                                  "(recovery resumes from the step before it)")


def _int(v: Any, path: str, what: str, hi: int = MAX_INT) -> int:
    if type(v) is not int or not 0 <= v <= hi:
        raise _fail(path, f"has a bad {what} ({str(v)[:40]})")
    return v


def read_header(root: str, rel: str, folder: int | None = None) -> Header | None:
    """The header of the record in ``root/rel`` (the prologue and header only are read); None when the slot holds
    no record (its prologue zeroed: being written, or invalidated). Raises CorruptCheckpointError naming the file
    for anything else that is not a valid header. ``folder``: ``rel``'s folder already open (``files.open_read``)."""
    path = os.path.join(root, rel)
    fd = open_read(root, rel, limit=MAX_RECORD_BYTES, folder=folder)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, PROLOGUE, 0)
        length, off, n = _prologue(head, size, path)
        if n < 0:
            return None
        raw = os.pread(fd, n, off)
    finally:
        os.close(fd)
    return _header(head, raw, length, off, path)


def parse_record(data: bytes | bytearray | memoryview, path: str) -> Header | None:
    """The header of the record held in ``data`` (a whole slot file's bytes, e.g. received from a peer)."""
    mv = memoryview(data)
    head = bytes(mv[:PROLOGUE])
    length, off, n = _prologue(head, len(mv), path)
    if n < 0:
        return None
    return _header(head, bytes(mv[off:off + n]), length, off, path)


def _prologue(head: bytes, size: int, path: str) -> tuple[int, int, int]:
    if len(head) < PROLOGUE or head[:8] != MAGIC:
        if head[:8].strip(b"\0") == b"":
            return 0, 0, -1
        raise _fail(path, "does not start with the step-log magic")
    length, off, n = struct.unpack("<QQQ", head[8:32])
    if not (PROLOGUE <= off and n <= MAX_HEADER_BYTES and off + n == length <= size):
        raise _fail(path, f"names a header of {n} bytes at {off} and a length of {length}; the record has {size}")
    return length, off, n


def _header(head: bytes, raw: bytes, length: int, off: int, path: str) -> Header:
    if digest(raw) != head[32:PROLOGUE].rstrip(b"\0").decode("ascii", "replace"):
        raise _fail(path, "header does not match its checksum (torn or damaged)")
    doc = loads(raw, path, MAX_HEADER_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(path, f"is not a {FORMAT} header")
    _int(doc.get("step"), path, "step")
    if _int(doc.get("world"), path, "world size", MAX_WORLD_SIZE) < 1:
        raise _fail(path, "has a world size of 0")
    _int(doc.get("rank"), path, "rank", doc["world"] - 1)
    if not isinstance(doc.get("layout"), str) or not isinstance(doc.get("calls"), list) or \
            not isinstance(doc.get("rest"), dict):
        raise _fail(path, "header lacks layout, calls or rest")
    if doc.get("checksum") not in CHECKSUM_ALGOS:
        raise _fail(path, f"names an unknown checksum algorithm {str(doc.get('checksum'))[:40]!r}")
    return Header(path, length, off, doc)


def read_record(root: str, rel: str, length: int) -> bytearray:
    """The first ``length`` bytes of the slot file ``root/rel`` (a record whose header said so; checked again by
    ``parse_record``)."""
    fd = open_read(root, rel, limit=MAX_RECORD_BYTES)
    try:
        if length > os.fstat(fd).st_size:
            raise _fail(os.path.join(root, rel), f"is shorter than the {length} bytes its header says")
        buf = bytearray(length)
        if length and os.preadv(fd, [buf], 0) != length:
            raise _fail(os.path.join(root, rel), "changed while it was read")
        return buf
    finally:
        os.close(fd)


def _locate(entry: Any, payload: bytearray | memoryview, path: str) -> tuple[int, int, torch.dtype, list[int]]:
    """(offset, length, dtype, shape) of a header entry, checked: bounds, dtype, shape × item size = length."""
    if not isinstance(entry, dict):
        raise _fail(path, "has a tensor entry that is not an object")
    off = _int(entry.get("off"), path, "tensor offset")
    n = _int(entry.get("len"), path, "tensor length")
    dt = _DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    shape = entry.get("shape")
    if dt is None or not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _fail(path, f"has a tensor of dtype {str(entry.get('dtype'))[:40]} and shape {str(shape)[:80]}")
    numel = 1
    for d in shape:
        numel *= _int(d, path, "tensor dimension")
        if numel > MAX_INT:
            raise _fail(path, "has a tensor too large")
    itemsize = torch.empty((), dtype=dt).element_size()
    if numel * itemsize != n or off < PROLOGUE or off + n > len(payload):
        raise _fail(path, f"has a tensor of {n} bytes at {off} that does not fit its shape or the record")
    return off, n, dt, shape


def tensor_at(entry: Any, payload: bytearray | memoryview, path: str, algo: str) -> torch.Tensor:
    """The tensor a header entry names in ``payload`` (checked: bounds, dtype, shape × item size = length, digest);
    a copy the caller owns."""
    off, n, dt, shape = _locate(entry, payload, path)
    view = memoryview(payload)[off:off + n]
    if digest(view, algo) != entry.get("digest"):
        raise _fail(path, f"tensor at bytes {off}..{off + n} does not match its checksum")
    t = torch.empty(shape, dtype=dt)
    if n:
        as_bytes(t)[:] = view
    return t


def tensor_view(entry: Any, payload: bytearray | memoryview, path: str) -> torch.Tensor:
    """The tensor a header entry names in the writable ``payload``, as a view into it (no copy): for a record
    whose checksums were verified already (bounds, dtype and shape are checked again; the digest is not). The
    view lives as long as ``payload``'s buffer; a write through it changes the record's bytes in memory."""
    off, n, dt, shape = _locate(entry, payload, path)
    if not n:
        return torch.empty(shape, dtype=dt)
    mv = memoryview(payload)
    size = torch.empty((), dtype=dt).element_size()
    if mv.readonly:                                         # (torch.frombuffer wants a writable buffer): a copy
        t = torch.empty(shape, dtype=dt)
        as_bytes(t)[:] = mv[off:off + n]
        return t
    flat = torch.frombuffer(mv, dtype=torch.uint8, count=n, offset=off)
    if flat.data_ptr() % size:                              # misaligned for the dtype: a copy, aligned
        flat = flat.clone()
    return flat.view(dt).view(shape)


__all__ = [
    "FORMAT",
    "HELD",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PROLOGUE",
    "RECORD_CHECKSUM",
    "Header",
    "Held",
    "as_bytes",
    "encode_header",
    "fill_held",
    "held_home",
    "held_size",
    "held_trailer",
    "parse_record",
    "prologue",
    "read_header",
    "read_held",
    "read_record",
    "tensor_at",
    "tensor_entry",
    "tensor_view",
]
