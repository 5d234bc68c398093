"""Execute planned reads: a pipeline of large aligned reads → verify → copy into the live tensors.

Units (whole hash blocks of one chunk, see ``planning.load_plan``) are sorted by file and offset and coalesced
into physical reads of up to ``max_read`` bytes, aligned to 4 KiB so that storage may use direct I/O (no page
cache: on these VMs the page cache costs a first touch of fresh memory per byte). A reader thread fills one
of two page-aligned scratch buffers while the caller's thread verifies and copies the other. Every block is
verified before any of its bytes reach a target tensor, so a corrupt block never lands in the state. Spans that
several ranks need may be shared (``planning.share_plan``): one rank reads and sends, the others receive.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from liferaft.codecs.frames import decode_frames, load_executor
from liferaft.core.chunks.blocks import read_blocks, xor_into
from liferaft.core.chunks.fused import verify_and_copy
from liferaft.core.chunks.fused import where_of as _where
from liferaft.core.chunks.memread import stream_units, streamable
from liferaft.core.chunks.shm import HostShare
from liferaft.errors import CorruptCheckpointError, DistributedError
from liferaft.planning.load_plan import CopySpec, ReadUnit
from liferaft.planning.share_plan import SharedSpan, Span
from liferaft.staging.pool import PAGE, page_aligned_empty
from liferaft.storage.base import Storage


@dataclass
class _Batch:
    """One job: ``length`` bytes of ``file`` from ``offset`` (page aligned for a storage read) holding ``units``.

    ``share`` marks a span read by one rank and sent to others: ``send`` (this rank reads it, then sends the
    span's bytes) or ``recv`` (this rank receives them instead of reading; then ``offset`` is the span's start).
    """

    file: str
    offset: int
    length: int
    units: list[tuple[ReadUnit, torch.dtype]]
    share: SharedSpan | None = None
    role: str = "local"

    @property
    def key(self) -> tuple[str, int, int]:
        if self.share is not None:
            return self.file, self.share.start, self.share.length
        first = min(u.file_offset for u, _ in self.units)
        return self.file, first, max(u.file_offset + u.length for u, _ in self.units) - first


@dataclass
class ReadStats:
    """Bytes a rank used for its targets, how many of them came from peers instead of storage, and the seconds
    spent verifying checksums (in the caller's thread, overlapped with the reads)."""

    used: int = 0
    received: int = 0
    verify_s: float = 0.0


class Peers(Protocol):
    """Point-to-point transfers between the ranks of a load (``dist.Coordinator``); both return a Work."""

    def isend(self, tensor: torch.Tensor, rank: int, tag: int) -> Any: ...

    def irecv(self, tensor: torch.Tensor, rank: int, tag: int) -> Any: ...


def _batches(units: Sequence[tuple[ReadUnit, torch.dtype]], max_read: int) -> list[_Batch]:
    """Coalesce units into physical reads of whole pages (so that storage may use O_DIRECT), at most
    ``max_read`` bytes each, the last ones shorter (``tail_cap``): the caller's thread verifies and copies one
    read while the next is in flight, so what follows the device is the last read's verify and copy only.
    (Measured: reading the partial units of a resharding load through the page cache instead, to share it between
    the ranks of a node, was not faster here.)"""
    out: list[_Batch] = []
    ordered = sorted(units, key=lambda ud: (ud[0].file, ud[0].file_offset))
    left = sum(u.length for u, _ in ordered)
    cap = max_read
    for unit, dtype in ordered:
        lo = unit.file_offset // PAGE * PAGE
        hi = -(-(unit.file_offset + unit.length) // PAGE) * PAGE
        last = out[-1] if out else None
        if last is not None and last.file == unit.file and lo <= last.offset + last.length + PAGE \
                and max(hi, last.offset + last.length) - last.offset <= cap:
            last.length = max(hi, last.offset + last.length) - last.offset
            last.units.append((unit, dtype))
        else:
            cap = tail_cap(left, max_read)
            out.append(_Batch(unit.file, lo, hi - lo, [(unit, dtype)]))
        left -= unit.length
    return out


TAIL_MIN = 2 << 20      # the shortest read the tail of a load is cut into


def tail_cap(left: int, max_read: int) -> int:
    """The most bytes of a physical read that starts with ``left`` bytes of the load still to read: ``max_read``,
    or half of what is left near the end (at least ``TAIL_MIN``), so that the reads shrink toward the end and the
    last one's verify and copy, which nothing overlaps, is short (32 MiB: ~7 ms here; 2 MiB: ~0.5 ms)."""
    return min(max_read, max(TAIL_MIN, left // 2 // PAGE * PAGE))


MIN_BATCH = 4 << 20     # the smallest physical read a load is cut into (a request's own cost stays small)
DEPTH = 8               # a load of fewer than DEPTH × max_read bytes is cut into about DEPTH reads


def batch_bytes(total: int, max_read: int) -> int:
    """The physical read size for a load of ``total`` bytes: ``max_read``, or less for a small load, so that it
    still takes about ``DEPTH`` reads (at least ``MIN_BATCH`` each). The caller's thread verifies and copies one
    read while the next is in flight, so only the last read's verify and copy follow the device; one read of a
    whole small load leaves all of them after it (a 2-rank load of 64 MiB: ~15 ms of ~75), and its buffer is as
    large as the load (fresh memory: ~1 GB/s to touch here). Never more than ``max_read`` (a unit larger than
    the result still takes one read of its own, as before)."""
    return min(max_read, max(MIN_BATCH, -(-total // DEPTH) // PAGE * PAGE))


def _jobs(units: Sequence[tuple[ReadUnit, torch.dtype]], max_read: int, rank: int,
          sharing: Mapping[Span, SharedSpan]) -> list[_Batch]:
    """Local reads coalesced as in ``_batches``; one job per shared span. Shared spans first (a peer waits for
    them; this rank's own reads do not keep it waiting), in tag (file) order on every rank; then local reads in
    file order."""
    shared: dict[int, _Batch] = {}
    local = []
    for unit, dtype in units:
        share = sharing.get((unit.file, unit.file_offset, unit.length))
        if share is None:
            local.append((unit, dtype))
        elif share.tag in shared:
            shared[share.tag].units.append((unit, dtype))
        elif share.reader == rank:
            lo = share.start // PAGE * PAGE
            hi = -(-(share.start + share.length) // PAGE) * PAGE
            shared[share.tag] = _Batch(unit.file, lo, hi - lo, [(unit, dtype)], share, "send")
        else:
            shared[share.tag] = _Batch(unit.file, share.start, share.length, [(unit, dtype)], share, "recv")
    for (file, start, length), share in sharing.items():    # spans read for others only (planning.share_plan)
        if share.reader == rank and share.tag not in shared:
            lo = start // PAGE * PAGE
            shared[share.tag] = _Batch(file, lo, -(-(start + length) // PAGE) * PAGE - lo, [], share, "send")
    return sorted(_batches(local, max_read) + list(shared.values()), key=lambda b: (b.share is None, b.key))


def execute_reads(storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]],
                  targets: Sequence[torch.Tensor], copy: bool = True, max_read: int = 32 << 20,
                  peers: Peers | None = None, rank: int = 0,
                  sharing: Mapping[Span, SharedSpan] | None = None, host: HostShare | None = None) -> ReadStats:
    """Run ``units`` (each with the dtype of its tensor) into ``targets``; return the bytes used and received.

    With ``copy=False`` the bytes are only read and verified (the first pass of an atomic load). With
    ``sharing`` (from ``planning.share_plan.plan_sharing``, the same on every rank) the shared spans this rank
    reads are sent to ``peers`` (spans this rank needs none of too: it reads them for others, unverified — the
    receivers verify) and those other ranks read are received instead of read; received bytes are verified like
    read ones. After a failure the transfers still run to the end (without reading or copying),
    so that no peer waits for a message that never comes; then the first error is raised.

    With ``host`` (the ranks of ``sharing`` are all on this host, ``core.chunks.shm``) no bytes travel over the
    process group: the reader of a shared span decodes and verifies it once into a slot of its own segment and
    sends a notice (slot, outcome, length); the receivers copy their boxes from that slot (not verified again)
    and acknowledge, which frees the slot. A span found corrupt is reported to every receiver, which raises too.

    From storage held in RAM (``Storage.memory_speed``) the units this rank reads for itself are streamed through
    a small cache-resident buffer instead (``core.chunks.memread``).
    """
    sharing = sharing or {}
    if not units and not any(s.reader == rank for s in sharing.values()):
        return ReadStats()
    if host is not None and sharing:
        assert peers is not None
        from liferaft.core.chunks.host_reads import HostReads  # (it builds on this module's jobs)
        return HostReads(storage, units, targets, copy, max_read, peers, rank, sharing, host).run()
    if copy and storage.memory_speed:
        return _from_memory(storage, units, targets, max_read, peers, rank, sharing)
    return _pipelined(storage, units, targets, copy, max_read, peers, rank, sharing)


def _from_memory(storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]], targets: Sequence[torch.Tensor],
                 max_read: int, peers: Peers | None, rank: int, sharing: Mapping[Span, SharedSpan]) -> ReadStats:
    """``execute_reads`` from storage held in RAM: the units this rank reads for itself alone and can stream
    (``core.chunks.memread``) are streamed; the rest (shared spans, encoded units, strided copies) run through
    the pipeline, in a second thread while this one streams when there are transfers (so that peers waiting for
    this rank's sends are not kept waiting), else after the streaming."""
    streamed, rest = [], []
    for unit, dtype in units:
        runs = None if (unit.file, unit.file_offset, unit.length) in sharing else streamable(unit, dtype, targets)
        if runs is None:
            rest.append((unit, dtype))
        else:
            streamed.append((unit, runs))
    transfers = any(s.reader == rank or rank in s.receivers for s in sharing.values())
    if not transfers:
        used, verify_s = stream_units(storage, streamed)
        stats = _pipelined(storage, rest, targets, True, max_read, peers, rank, sharing) if rest else ReadStats()
        return ReadStats(stats.used + used, stats.received, stats.verify_s + verify_s)
    out: list[ReadStats] = []
    errors: list[BaseException] = []

    def pipeline() -> None:
        try:
            out.append(_pipelined(storage, rest, targets, True, max_read, peers, rank, sharing))
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread below
            errors.append(e)

    other = threading.Thread(target=pipeline, name="liferaft-transfers", daemon=True)
    other.start()
    try:
        used, verify_s = stream_units(storage, streamed)
    finally:
        other.join()            # (the transfers run to their end whatever this thread met)
    if errors:
        raise errors[0]
    return ReadStats(out[0].used + used, out[0].received, out[0].verify_s + verify_s)


def _pipelined(storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]], targets: Sequence[torch.Tensor],
               copy: bool, max_read: int, peers: Peers | None, rank: int,
               sharing: Mapping[Span, SharedSpan]) -> ReadStats:
    """``execute_reads`` from a device: a reader thread fills large page-aligned buffers while this thread
    verifies and copies (and sends and receives the shared spans)."""
    stats = ReadStats()
    if not units and not any(s.reader == rank for s in sharing.values()):
        return stats
    jobs = _jobs(units, max([batch_bytes(sum(u.length for u, _ in units), max_read)] +
                            [-(-(u.length + 2 * PAGE) // PAGE) * PAGE for u, _ in units]), rank, sharing)
    size = max(b.length for b in jobs)
    free: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(min(len(jobs), 3 if sharing else 2)):
        free.put(page_aligned_empty(size))
    ready: queue.Queue[tuple[_Batch, torch.Tensor, int, list[Any]]] = queue.Queue()
    errors: list[BaseException] = []
    comm_ok = [True]

    def fail(e: BaseException) -> None:
        errors.append(e)

    def read_all() -> None:
        for b in jobs:
            buf = free.get()
            n, works = 0, []
            try:
                if b.role != "recv" and not errors:
                    try:
                        n = storage.read_into(b.file, b.offset, memoryview(buf[:b.length].numpy()))
                    except FileNotFoundError:
                        raise CorruptCheckpointError(f"{storage.url}: data file {b.file!r} is missing") from None
                if b.share is not None and comm_ok[0]:
                    assert peers is not None
                    if b.role == "send":
                        (_, start, length) = b.key
                        part = buf[start - b.offset:start - b.offset + length]
                        works = [peers.isend(part, r, b.share.tag) for r in b.share.receivers]
                    else:
                        works = [peers.irecv(buf[:b.length], b.share.reader, b.share.tag)]
                        n = b.length
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread; transfers go on
                fail(e)
            ready.put((b, buf, n, works))

    reader = threading.Thread(target=read_all, name="liferaft-reader", daemon=True)
    reader.start()
    for _ in jobs:
        batch, buf, n, works = ready.get()
        try:
            for w in works:
                if comm_ok[0]:
                    _wait(w, batch)
            if batch.role == "send" and not batch.units and n < batch.share.start + batch.share.length - batch.offset:
                raise CorruptCheckpointError(f"{storage.url}: data file {batch.file!r} is truncated (read {n} bytes "
                                             f"from {batch.offset}, needed through {batch.share.start + batch.share.length})")
            if not errors:
                stats.verify_s += _consume(storage, batch, buf, n, targets, copy)
                stats.used += sum(u.length for u, _ in batch.units)
                stats.received += batch.length if batch.role == "recv" else 0
        except DistributedError as e:
            comm_ok[0] = False
            fail(e)
        except BaseException as e:  # noqa: BLE001 - raised below, after the transfers have run to the end
            fail(e)
        free.put(buf)
    reader.join()
    if errors:
        raise errors[0]
    return stats


def _wait(work: Any, batch: _Batch) -> None:
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - gloo reports a lost or silent peer as RuntimeError
        raise DistributedError(f"sharing bytes {batch.key[1]}.. of {batch.file!r} with rank(s) "
                               f"{batch.share and (batch.share.receivers if batch.role == 'send' else batch.share.reader)}"
                               f" failed (a peer died or did not answer): {e}") from None


def _decode(unit: ReadUnit, view: torch.Tensor, dtype: torch.dtype, pool: Any) -> torch.Tensor:
    """The raw bytes of an encoded unit (``pool``: the executor for its frames, or None to decode them here)."""
    assert unit.frames is not None
    raw = torch.empty(unit.decoded_length, dtype=torch.uint8)
    decode_frames(memoryview(view.numpy()), unit.frames, unit.codec or "", memoryview(raw.numpy()),
                  unit.block_size, str(dtype).removeprefix("torch."), _where(unit), pool, serial=pool is None)
    return raw


def _consume(storage: Storage, batch: _Batch, buf: torch.Tensor, n: int, targets: Sequence[torch.Tensor],
             copy: bool, keep: Any = None) -> float:
    """Decode, verify every unit of ``batch`` in ``buf`` and copy it into its targets; return the seconds
    verifying. Encoded units are decoded on the codec threads: several units in parallel, or one unit's
    frames in parallel. ``keep``, if given, gets the first unit's decoded and verified bytes (a shared span's,
    for the ranks that copy from it)."""
    verify_s = 0.0
    views: list[torch.Tensor] = []
    for unit, _ in batch.units:
        inner = unit.file_offset - batch.offset
        if n < inner + unit.length:
            raise CorruptCheckpointError(f"{_where(unit)}: the file is truncated (read {max(0, n - inner)} of "
                                         f"{unit.length} bytes)")
        views.append(buf[inner:inner + unit.length])
    encoded = [i for i, (u, _) in enumerate(batch.units) if u.codec is not None]
    if len(encoded) > 1:
        decoded = load_executor().map(lambda i: _decode(batch.units[i][0], views[i], batch.units[i][1], None),
                                      encoded)
        for i, raw in zip(encoded, decoded):
            views[i] = raw
    elif encoded:
        i = encoded[0]
        views[i] = _decode(batch.units[i][0], views[i], batch.units[i][1], load_executor())
    for (unit, dtype), view in zip(batch.units, views):
        if unit.delta is not None:
            if unit.codec is None:
                view = view.clone()
            end = unit.first_block + len(unit.hashes)
            xor_into(memoryview(view.numpy()), read_blocks(storage, unit.delta, unit.first_block, end,
                                                           str(dtype).removeprefix("torch."), unit.key))
        seconds, rest = verify_and_copy(unit, view, dtype, targets, copy, _where(unit))
        verify_s += seconds
        if keep is not None:
            keep(view)
            keep = None
        if rest:
            copy_out(unit, view, dtype, targets, rest)
    return verify_s


def copy_out(unit: ReadUnit, view: torch.Tensor, dtype: torch.dtype, targets: Sequence[torch.Tensor],
             copies: Sequence[CopySpec] | None = None) -> None:
    """Copy the verified bytes ``view`` of ``unit`` into the boxes of its targets (strided views): every copy
    of the unit, or only ``copies``."""
    flat = view.view(dtype)
    with torch.no_grad():
        for c in unit.copies if copies is None else copies:
            src = torch.as_strided(flat, c.sizes, c.src_strides, flat.storage_offset() + c.src_offset)
            dst = targets[c.target]
            for d, (o, s) in enumerate(zip(c.dest_offsets, c.sizes)):
                dst = dst.narrow(d, o, s)
            dst.copy_(src)

