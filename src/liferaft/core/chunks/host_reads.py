"""``execute_reads`` when the ranks that share spans are on one host: verified bytes pass through shared memory.

The jobs are those of ``core.chunks.reader`` (local reads coalesced, one job per shared span, in file order, so
shared spans come in tag order on every rank of the host). ``planning.share_plan`` gives each reader runs of
adjacent spans (``run_bytes``: up to ``max_read_bytes``), so a reader thread reads a run of plain spans with one
large request into the next slot of this rank's segment (``core.chunks.shm``, once the receivers of the slot's
last read are done with it; ``_group``; by O_DIRECT from a device through a private buffer of huge pages, then
one copy: O_DIRECT into the slot's 4 KiB shared-memory pages ran at about half the speed, ``_bounce``); anything else (an encoded or delta span, a local read) alone,
into two scratch buffers. The caller's thread verifies them (a plain span in place in its slot; an encoded one is
decoded and verified, then put into the slot) and copies its own boxes; once every span of a slot's read is done,
one notice tells each receiver about them all — per span ``(slot, outcome, length, identity, offset)``, at most
``MAX_BATCH`` — over the process group. A receiving thread (so that a rank's own reads never wait for its peers'
and the ranks work at the same time) waits for each notice in turn, copies its boxes from the reader's slot and
acknowledges the notice once; a slot is written again only after every receiver of its last read acknowledged.
Every byte is read from storage and verified once on the host; what each receiver copies is the bytes its
reader verified. (One message per span made a resharding load's hundreds of small spans cost more than reading
them twice.)

A span is the stored bytes (file, offset, length); two records may name the same span yet decode it differently
(another codec or frames, a delta base, other hashes). So the notice carries the decode identity
(``decode_identity``) of the unit whose bytes fill the slot, and a receiver copies from the slot only the units
of that identity; any other unit of the span it reads, decodes and verifies alone (by its own record), exactly
as if nothing were shared. No unit is ever given bytes not verified against its own record.

Failures: a span found corrupt (or unreadable) is announced as such in its notice, and each receiver raises an
error naming the file, the key and the bytes; after any failure the notices and acknowledgements still run to the
end (no peer waits for a message that never comes). A notice that does not fit the receiver's plan (count, first
tag) stops the messages as a lost peer does. A peer that dies is seen as a failed wait, bounded by the
coordinator's timeout (``DistributedError``); from then on no more messages are exchanged.
"""

from __future__ import annotations

import ctypes
import hashlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from liferaft.core.chunks.reader import (
    Peers,
    ReadStats,
    _Batch,
    _consume,
    _jobs,
    _wait,
    _where,
    copy_out,
)
from liferaft.core.chunks.shm import HostShare, Segment
from liferaft.errors import CorruptCheckpointError, DistributedError
from liferaft.planning.load_plan import ReadUnit
from liferaft.planning.share_plan import RUN_GAP, SharedSpan, Span
from liferaft.staging.pool import PAGE, page_aligned_empty
from liferaft.storage.base import Storage
from liferaft.storage.iobuf import HUGE_FROM, HUGE_MAX

OK, FAILED, CORRUPT = 1, 0, 2
MAX_BATCH = 64                  # the most spans one notice tells (the spans of one slot's read, ``_group``)
NOTICE_LEN = 2 + 5 * MAX_BATCH  # int64s of a notice: count, first tag, then per span (slot, outcome, length,
                                # identity, offset)


def view_bytes(unit: ReadUnit) -> int:
    """Bytes of ``unit`` once decoded: what a slot holds for it."""
    return unit.decoded_length if unit.codec is not None else unit.length


def decode_identity(unit: ReadUnit) -> int:
    """A 64-bit digest of everything that decides the verified bytes of ``unit`` (all its record but the key and
    the copies into targets): the same on every rank for the same record; two units with equal identities end up
    with the same bytes."""
    ident = (unit.file, unit.file_offset, unit.length, unit.block_size, unit.hashes, unit.codec, unit.frames,
             unit.raw_length, unit.first_block, unit.delta, unit.checksum)
    return int.from_bytes(hashlib.blake2b(repr(ident).encode(), digest_size=8).digest(), "little", signed=True)


class HostReads:
    """One run of the reads of a rank whose shared spans are shared with ranks of its host (see the module)."""

    def __init__(self, storage: Storage, units: Sequence[tuple[ReadUnit, torch.dtype]],
                 targets: Sequence[torch.Tensor], copy: bool, max_read: int, peers: Peers, rank: int,
                 sharing: Mapping[Span, SharedSpan], host: HostShare) -> None:
        self.storage, self.targets, self.copy, self.peers, self.host = storage, targets, copy, peers, host
        longest = max(-(-(u.length + 2 * PAGE) // PAGE) * PAGE for u, _ in units)
        self.jobs = _jobs(units, max(max_read, longest), rank, sharing)
        self.errors: list[BaseException] = []
        self.comm_ok = True
        # per slot: the acknowledgements its last read awaits (put by the caller's thread once the notice is
        # posted, taken by the reader thread before it fills the slot again)
        self.released: list[queue.Queue[list[Any]]] = [queue.Queue() for _ in range(host.own.slots if host.own
                                                                                  else 0)]
        for q in self.released:
            q.put([])
        self.batch: list[list[int]] = []           # the notice entries of the group being verified
        self.inbox: dict[int, tuple[list[int], bool, int]] = {}     # tag -> (entry, last of its notice, first tag)
        self.sent: list[Any] = []          # sends under way (their tensors kept alive with them)
        self.stats = ReadStats()
        self.received_stats = ReadStats()       # counted by the receiving thread
        self.identities: dict[int, int] = {}    # id(unit) -> decode_identity (the units live as long as the run)

    def _identity(self, unit: ReadUnit) -> int:
        """``decode_identity(unit)``, computed once per unit of this run (~10 us each: a digest of its record)."""
        found = self.identities.get(id(unit))
        if found is None:
            found = self.identities[id(unit)] = decode_identity(unit)
        return found

    def _direct(self, b: _Batch) -> bool:
        """Whether shared span ``b`` is read straight into its slot: its first unit (the one whose bytes fill
        the slot) is stored plain (no codec, no delta), so the stored bytes are the verified ones."""
        return b.role == "send" and bool(b.units) and b.units[0][0].codec is None \
            and b.units[0][0].delta is None and b.length <= self._own.slot_bytes

    def _bounce(self, direct: Sequence[_Batch]) -> torch.Tensor | None:
        """The private buffer a device's O_DIRECT reads of shared spans land in before one copy into their slot
        (read straight into the slot's 4 KiB shared-memory pages they ran at about half the speed here), or None
        (reads straight into the slot): only when the buffer is of huge pages (``storage.iobuf``: slots of
        ``HUGE_FROM`` to ``HUGE_MAX`` bytes) and the storage reads its first such span by O_DIRECT (not from RAM,
        not through the page cache)."""
        size = self._own.slot_bytes if direct else 0
        if not direct or self.storage.memory_speed or not HUGE_FROM <= size <= HUGE_MAX:
            return None
        inner, name = self.storage.route(direct[0].file) if hasattr(self.storage, "route") \
            else (self.storage, direct[0].file)
        io_path = getattr(inner, "io_path", None)
        if io_path is None or not io_path(direct[0].length, False, name)[0]:
            return None
        return page_aligned_empty(size)

    @property
    def _own(self) -> Segment:
        """This rank's segment (it has one whenever it reads a shared span: ``core.load._set_up_host``)."""
        if self.host.own is None:
            raise DistributedError("this rank reads shared spans but has no shared-memory segment; the ranks "
                                   "planned different reads")
        return self.host.own

    def run(self) -> ReadStats:
        own = [b for b in self.jobs if b.role != "recv"]
        staged = [b for b in own if not self._direct(b)]
        free: queue.Queue[torch.Tensor] = queue.Queue()
        if staged:
            size = max(b.length for b in staged)
            for _ in range(min(len(staged), 2)):
                free.put(page_aligned_empty(size))
        # per job of ``own``: (buffer, bytes read into it, error, slot, the job's byte in its slot, last of its
        # slot's read, tag of the first span of that read)
        ready: queue.Queue[tuple[torch.Tensor, int, BaseException | None, int, int, bool, int]] = queue.Queue()

        def read_all() -> None:
            try:
                read_from()
            except BaseException as e:  # noqa: BLE001 - a bug, not an I/O error: stop the messages (the peers'
                self._fail(e, lost=True)  # waits end at the timeout) and give every job an entry, so none hangs
                for _ in range(len(own) - produced[0]):
                    ready.put((torch.empty(0, dtype=torch.uint8), 0, e, -1, 0, True, -1))

        produced = [0]

        bounce = self._bounce([b for b in own if self._direct(b)])
        seg = self.host.own
        reserver = None         # reserves the slots past the first while the first is read (``Segment.reserve_rest``)
        if seg is not None and seg.reserved < seg.slots:
            reserver = threading.Thread(target=seg.reserve_rest, name="liferaft-reserve", daemon=True)
            reserver.start()

        def read_from() -> None:
            nxt = i = 0
            ring = self._own.slots if any(b.role == "send" for b in own) else 1
            while i < len(own):
                b = own[i]
                group = self._group(own, i)
                slot = -1
                if b.role == "send":
                    if nxt and reserver is not None and ring > self._own.reserved:
                        reserver.join()         # (the first use of a slot past the first)
                        ring = self._own.reserved
                        nxt %= ring
                    slot, nxt = nxt, (nxt + 1) % ring
                    self._acquire(slot, b)
                length = max(g.offset + g.length for g in group) - b.offset
                buf = self._own.slot(slot, length) if self._direct(b) else free.get()
                into = bounce if bounce is not None and self._direct(b) else buf
                n, err = 0, None
                if not self.errors or b.role == "send":         # a shared span is provided whatever else failed
                    try:
                        n = self.storage.read_into(b.file, b.offset, memoryview(into[:length].numpy()))
                    except FileNotFoundError:
                        err = CorruptCheckpointError(f"{self.storage.url}: data file {b.file!r} is missing")
                    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                        err = e
                if into is not buf and n > 0:   # (one thread, without the GIL: ctypes calls release it)
                    ctypes.memmove(buf.data_ptr(), into.data_ptr(), min(n, length))
                first = b.share.tag if b.share is not None else -1
                if len(group) == 1:              # (a scratch buffer goes back to ``free`` whole)
                    ready.put((buf, n, err, slot, 0, True, first))
                for k, g in enumerate(group if len(group) > 1 else ()):
                    at = g.offset - b.offset
                    ready.put((buf[at:at + g.length], max(0, min(g.length, n - at)), err, slot, at,
                               k == len(group) - 1, first))
                i += len(group)
                produced[0] = i

        def receive_all() -> None:
            for b in self.jobs:
                if b.role == "recv":
                    self._receive(b)
            if self.inbox and self.comm_ok:
                self._fail(DistributedError(f"a peer of this host told about {len(self.inbox)} shared span(s) this "
                                            f"rank does not read (tags {sorted(self.inbox)[:5]}); the ranks planned "
                                            f"different reads"))

        reader = threading.Thread(target=read_all, name="liferaft-reader", daemon=True)
        receiver = threading.Thread(target=receive_all, name="liferaft-receiver", daemon=True)
        reader.start()
        receiver.start()
        try:
            for b in own:
                buf, n, err, slot, at, last, first = ready.get()
                try:
                    if err is not None:
                        self._fail(err)
                    if b.role == "send" and first >= 0:     # (first < 0: the reader thread failed before it)
                        self._send(b, buf, n, slot, at, last, first)
                    elif not self.errors:
                        self.stats.verify_s += _consume(self.storage, b, buf, n, self.targets, self.copy)
                        self.stats.used += sum(u.length for u, _ in b.units)
                except BaseException as e:  # noqa: BLE001 - raised below, after the messages have run
                    self._fail(e)
                if not self._direct(b):
                    free.put(buf)
            reader.join()
            receiver.join()
            if self.comm_ok:
                for w in [w for q in self.released for w, _ in q.get()] + [w for w, _ in self.sent]:
                    try:
                        w.wait()
                    except Exception as e:  # noqa: BLE001 - a lost peer
                        self._fail(DistributedError(f"a peer of this host did not answer while sharing reads "
                                                    f"(it died or hung): {e}"), lost=True)
                        break
        finally:
            reader.join()
            receiver.join()
            if reserver is not None:
                reserver.join()         # (before the segment, and the descriptor it reserves through, close)
        if self.errors:
            raise self.errors[0]
        self.stats.used += self.received_stats.used
        self.stats.verify_s += self.received_stats.verify_s
        self.stats.received = self.received_stats.received
        return self.stats

    def _fail(self, e: BaseException, lost: bool = False) -> None:
        """Keep ``e`` to raise at the end; ``lost``: a wait failed, so no more messages are exchanged."""
        self.comm_ok = self.comm_ok and not lost
        self.errors.append(e)

    def _group(self, own: list[_Batch], i: int) -> list[_Batch]:
        """The jobs read with one request from ``own[i]`` on: the shared spans this rank reads straight into one
        slot (``_direct``) whose tags follow ``own[i]``'s, in its file, each starting at most ``RUN_GAP`` past the
        previous one's end (the bytes between are read and not used), as many as fit in the slot
        (``planning.share_plan`` gives a reader runs of such spans); any other job alone."""
        group = [own[i]]
        if not self._direct(own[i]):
            return group
        end = own[i].offset + own[i].length
        for b in own[i + 1:]:
            assert b.share is not None or not self._direct(b)
            if len(group) == MAX_BATCH or not self._direct(b) or b.share.tag != group[-1].share.tag + 1 \
                    or b.share.receivers != own[i].share.receivers or b.file != own[i].file \
                    or not own[i].offset <= b.offset <= end + RUN_GAP \
                    or max(end, b.offset + b.length) - own[i].offset > self._own.slot_bytes:
                break
            group.append(b)
            end = max(end, b.offset + b.length)
        return group

    def _acquire(self, slot: int, b: _Batch) -> None:
        """(Reader thread) Wait until the receivers of ``slot``'s last span are done with it."""
        acks = self.released[slot].get()
        try:
            for w, _ in acks if self.comm_ok else ():
                _wait(w, b)
        except DistributedError as e:
            self._fail(e, lost=True)

    def _send(self, b: _Batch, buf: torch.Tensor, n: int, slot: int, at: int, last: bool, first: int) -> None:
        """Verify the shared span ``b`` (read into ``slot`` itself from its byte ``at``, or decoded into it from
        ``buf``) and copy this rank's boxes; its notice entry (the slot's bytes verified, or how it failed) joins
        those of the spans read with it, and once its slot's ``last`` span is done, one notice (tag ``2 * first``,
        ``first`` the tag of the slot's first span) tells each receiver about them all; the slot is released once
        every receiver acknowledged that notice (tag ``2 * first + 1``)."""
        assert b.share is not None
        own, direct = self._own, self._direct(b)
        identity = self._identity(b.units[0][0]) if b.units else 0      # the unit whose bytes fill the slot
        entry: list[int] = []

        def keep(view: torch.Tensor) -> None:
            if direct:                      # the view is the slot's own bytes, verified in place
                entry[:] = [slot, OK, view.numel(), identity, at + b.units[0][0].file_offset - b.offset]
            else:
                own.slot(slot, view.numel()).copy_(view)
                entry[:] = [slot, OK, view.numel(), identity, 0]
        try:
            status = FAILED
            if n:
                try:
                    self.stats.verify_s += _consume(self.storage, b, buf, n, self.targets, self.copy, keep=keep)
                    self.stats.used += sum(u.length for u, _ in b.units)
                    status = OK
                except CorruptCheckpointError as e:
                    status = CORRUPT
                    self._fail(e)
                except BaseException as e:  # noqa: BLE001 - the receivers are told, then it is raised
                    self._fail(e)
            if not entry:                   # failed before the slot's bytes were verified (or a span of no unit)
                entry[:] = [slot, status, 0, identity, 0]
        finally:
            self.batch.append(entry or [slot, FAILED, 0, identity, 0])
            if last:
                self._tell(b, slot, first)

    def _tell(self, b: _Batch, slot: int, first: int) -> None:
        """Send the notice of the spans read into ``slot`` (``self.batch``, from tag ``first`` on) to the
        receivers of ``b`` (those of every span of the slot, ``_group``) and release the slot once they answer."""
        entries, self.batch = self.batch, []
        assert b.share is not None and 0 < len(entries) <= MAX_BATCH
        acks: list[Any] = []
        try:
            if self.comm_ok:
                notice = torch.zeros(NOTICE_LEN, dtype=torch.int64)
                notice[:2 + 5 * len(entries)] = torch.tensor([len(entries), first] + [x for e in entries for x in e],
                                                             dtype=torch.int64)
                for r in b.share.receivers:
                    self.sent.append((self.peers.isend(notice, r, 2 * first), notice))
                    ack = torch.zeros(1, dtype=torch.int64)
                    acks.append((self.peers.irecv(ack, r, 2 * first + 1), ack))
        except Exception as e:  # noqa: BLE001 - gloo refuses to post to a lost peer
            self._fail(_lost(b, e), lost=True)
        finally:
            self.released[slot].put(acks)

    def _receive(self, b: _Batch) -> None:
        """Wait for the notice of shared span ``b``, copy this rank's boxes from its reader's slot, acknowledge."""
        assert b.share is not None
        if not self.comm_ok:
            return
        source = b.share.reader
        if b.share.tag not in self.inbox and not self._take_notice(b):
            return
        (slot, status, length, identity, offset), last, first = self.inbox.pop(b.share.tag)
        unit = b.units[0][0]
        try:
            if status == CORRUPT:
                raise CorruptCheckpointError(f"{_where(unit)}: rank {source}, which read these bytes for the ranks of "
                                             f"this host, found them corrupt (its error names the block); the "
                                             f"checkpoint is damaged: load an earlier one")
            if status != OK:
                raise DistributedError(f"{_where(unit)}: rank {source}, which reads these bytes for the ranks of "
                                       f"this host, failed before it could provide them (its own error says why)")
            if not self.errors:
                alike = [(u, dtype) for u, dtype in b.units if self._identity(u) == identity]
                for u, dtype in alike:
                    if view_bytes(u) != length:
                        raise DistributedError(f"{_where(u)}: rank {source} shared {length} bytes, this rank "
                                               f"expected {view_bytes(u)}; the ranks planned different reads")
                    if self.copy:
                        copy_out(u, self.host.peers[source].slot(slot, length, offset), dtype, self.targets)
                self.received_stats.used += sum(u.length for u, _ in alike)
                self.received_stats.received += b.length if alike else 0
                for u, dtype in b.units:            # same bytes, another record: as if read alone
                    if self._identity(u) != identity:
                        self._read_alone(u, dtype)
        except BaseException as e:  # noqa: BLE001 - acknowledged first, raised at the end
            self._fail(e)
        if not last:
            return
        ack = torch.ones(1, dtype=torch.int64)
        try:
            self.sent.append((self.peers.isend(ack, source, 2 * first + 1), ack))
        except Exception as e:  # noqa: BLE001 - gloo refuses to post to a lost peer
            self._fail(_lost(b, e), lost=True)

    def _take_notice(self, b: _Batch) -> bool:
        """(Receiving thread) Wait for the notice that tells about shared span ``b``: the next one from its reader,
        which starts at ``b``'s tag (a reader's notice tells about consecutive spans, all with the same receivers);
        put its entries in ``inbox``. False (no more messages) if the peer is lost or sent a notice that does not
        fit this rank's plan."""
        assert b.share is not None
        notice = torch.zeros(NOTICE_LEN, dtype=torch.int64)
        try:
            _wait(self.peers.irecv(notice, b.share.reader, 2 * b.share.tag), b)
        except DistributedError as e:
            self._fail(e, lost=True)
            return False
        except Exception as e:  # noqa: BLE001 - gloo refuses to post to a lost peer
            self._fail(_lost(b, e), lost=True)
            return False
        values = notice.tolist()
        count, first = values[0], values[1]
        if not 1 <= count <= MAX_BATCH or first != b.share.tag:
            self._fail(DistributedError(f"{_where(b.units[0][0])}: rank {b.share.reader} sent a notice of {count} "
                                        f"span(s) from tag {first}, this rank expected one from tag {b.share.tag}; "
                                        f"the ranks planned different reads"), lost=True)
            return False
        for k in range(count):
            self.inbox[first + k] = (values[2 + 5 * k:7 + 5 * k], k == count - 1, first)
        return True


    def _read_alone(self, unit: ReadUnit, dtype: torch.dtype) -> None:
        """Read, decode, verify and copy ``unit`` by its own record (in the receiving thread)."""
        lo = unit.file_offset // PAGE * PAGE
        batch = _Batch(unit.file, lo, -(-(unit.file_offset + unit.length) // PAGE) * PAGE - lo, [(unit, dtype)])
        buf = page_aligned_empty(batch.length)
        try:
            n = self.storage.read_into(unit.file, batch.offset, memoryview(buf.numpy()))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.storage.url}: data file {unit.file!r} is missing") from None
        self.received_stats.verify_s += _consume(self.storage, batch, buf, n, self.targets, self.copy)
        self.received_stats.used += unit.length


def _lost(b: _Batch, e: BaseException) -> DistributedError:
    return DistributedError(f"sharing {b.file!r} bytes {b.key[1]}.. with the ranks of this host failed (a peer died "
                            f"or did not answer): {e}")
