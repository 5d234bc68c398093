"""Replication of step records to peer nodes, without sending what the peer already holds (docs/STEPLOG.md).

Under data parallelism every rank's gradients are the same bytes (DDP all-reduces them), so a peer's own record
of the same step already holds the gradients of the record it is to keep a copy of. Each replication therefore:

1. exchanges with each target and source (small messages on the background group): the slot, step and length of
   the record, then one row per recorded gradient (offset, length, its XXH3-64 as two 32-bit halves — the
   record's own digest, ``steprecord.RECORD_CHECKSUM``, computed when the gradient was recorded; -1 for none);
2. the receiver decides, per gradient, whether its own record of the same step holds the same bytes: the same
   length and the same 64-bit digest (never a 32-bit CRC-32C: colliding gradients are easy to make), and that
   gradient of that source never differed before (a gradient that differed once is sent in full from then on: a
   DDP run whose gradients diverge, or ranks that are not data parallel for it, pay one digest comparison per
   gradient, not one per step); it sends that mask back;
3. the sender sends the record's bytes less the gradients the receiver holds (one message, copied from its
   mapped slot); the receiver writes the received bytes (the header, the rest of the state, the gradients it
   does not hold, the padding between them) into the replica's slot, and, past the record's end, a *held
   trailer* (``steprecord.held_trailer``) naming where in its own record of the step the held gradients are
   (runs laid out alike merged: under DDP, one run for all of them), and the prologue last. The held gradients
   are not copied: a record costs its peer the bytes it does not already hold, nothing more.

A recovery reading the replica (``steplog``) fills the held runs from the holder's own record of that step
(which it has read and verified) and verifies the whole record, every tensor against the sender's checksums, as
any record: the bytes it serves are the sender's record. A replica is only as good as the holder's own record of
the same step (a damaged own record makes the replica of that step unusable too; the sender's own copy still
serves). Everything received is checked against the record's length before it is used (a malformed row makes
that record go in full).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from liferaft.codecs.checksum import digest
from liferaft.dist import Coordinator
from liferaft.errors import CorruptCheckpointError, DistributedError
from liferaft.tiers.steprecord import HELD, MAX_HELD_RUNS, MAX_RECORD_BYTES, PROLOGUE, held_trailer

MAX_GRADS = 1 << 22


def _rows(entries: list[dict[str, Any] | None], own: memoryview, algo: str = "xxh3_64") -> torch.Tensor:
    """One int64 row per gradient entry: offset, length, and the high and low 32 bits of the XXH3-64 of its bytes
    in this rank's own record ``own`` (-1s for none): the entry's digest when the record's checksum ``algo`` is
    XXH3-64 (what records are written with), else hashed here. 64 bits: whether a peer's gradient is "the same
    bytes" is never decided on a 32-bit checksum (two different gradients with one CRC-32C are easy to make)."""
    rows = []
    for e in entries:
        if e is None:
            rows.append((-1, -1, -1, -1))
        else:
            off, n = e["off"], e["len"]
            if not (0 <= off and off + n <= len(own)):
                raise CorruptCheckpointError(f"a gradient entry [{off}, {off + n}) is outside this rank's per-step "
                                             f"record of {len(own)} bytes")
            if not n:
                d = 0
            elif algo == "xxh3_64":
                d = int(e["digest"], 16)
            else:
                d = int(digest(own[off:off + n], "xxh3_64"), 16)
            rows.append((off, n, d >> 32 & 0xFFFFFFFF, d & 0xFFFFFFFF))
    return torch.tensor(rows, dtype=torch.int64).reshape(len(entries), 4)


def _runs(pairs: list[tuple[int, int, int]], gap: int = 4096) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, length) copies merged where consecutive ones keep the same distance
    between source and destination and follow each other in both, at most ``gap`` bytes apart (the gaps between
    them copied too)."""
    out: list[tuple[int, int, int]] = []
    for src, dst, n in sorted(pairs, key=lambda p: p[1]):
        if out:
            s0, d0, n0 = out[-1]
            if src - dst == s0 - d0 and d0 + n0 <= dst and dst - (d0 + n0) <= gap:
                out[-1] = (s0, d0, dst + n - d0)
                continue
        out.append((src, dst, n))
    return out


def _ranges(length: int, rows: list[list[int]], mask: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of the record's bytes outside the gradients ``mask`` marks (the receiver holds them);
    ``rows`` and ``mask`` as lists (``tolist`` once: indexing a tensor element by element costs microseconds). A
    mark on a row without bytes (no gradient: -1s) is ignored."""
    skip = sorted((r[0], r[1]) for r, m in zip(rows, mask, strict=True) if m and r[1] > 0)
    out, pos = [], 0
    for off, n in skip:
        if off > pos:
            out.append((pos, off - pos))
        pos = off + n
    if pos < length:
        out.append((pos, length - pos))
    return out


def _valid(rows: list[list[int]], length: int) -> bool:
    """The rows (as lists) name disjoint byte ranges past the prologue inside a record of ``length`` bytes."""
    spans = sorted((r[0], r[1]) for r in rows if r[1] > 0)
    pos = PROLOGUE
    for off, n in spans:
        if off < pos or off + n > length:
            return False
        pos = off + n
    return all(r[1] >= 0 or r[0] == -1 for r in rows)


def _announced(src: int, head: torch.Tensor) -> int:
    """The number of gradient rows rank ``src`` announced in ``head`` (slot, step, record length, gradients), each
    field checked before anything is allocated for it: DistributedError naming the rank otherwise. 0 bytes and
    no gradients: no record of that step there (``Sender.skip``)."""
    slot, _, length, grads = (int(v) for v in head)
    if not ((length == 0 == grads or PROLOGUE <= length <= MAX_RECORD_BYTES) and 0 <= grads <= MAX_GRADS
            and slot >= 0):
        raise DistributedError(f"per-step log replication: rank {src} announced a step record of {length} bytes "
                               f"and {grads} gradients in slot {slot} (0 bytes and none, or {PROLOGUE} to "
                               f"{MAX_RECORD_BYTES} bytes and at most "
                               f"{MAX_GRADS} gradients): not a liferaft peer of this version, or its record is "
                               "damaged; the replication of its records stops (restart the job)")
    return grads


class Sender:
    """The replication of one step log: ``run`` once per published record, in its background thread."""

    def __init__(self, root: str, coord: Coordinator, rank: int, targets: list[int], sources: list[int],
                 name: Callable[[int, int], str], slot: Callable[..., Any]) -> None:
        self.root, self.coord, self.rank, self.targets, self.sources = root, coord, rank, targets, sources
        self.name, self.slot = name, slot   # slot(rel, size, holes): that slot file, mapped, at least size bytes
        self.diverged: set[tuple[int, int]] = set()    # (source, gradient index) that differed once
        self.matched: set[tuple[int, int]] = set()
        self.warned = False
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        #: bytes of gradients not sent in the last run (for logs and tests)
        self.saved_bytes = 0

    def _buffer(self, kind: str, peer: int, n: int) -> torch.Tensor:
        buf = self.buffers.get((kind, peer))
        if buf is None or buf.numel() < n:          # kept between steps: no fresh pages per step
            buf = self.buffers[(kind, peer)] = torch.empty(max(n, 1 << 16), dtype=torch.uint8)
        return buf[:n]

    def run(self, slot: int, step: int, length: int, entries: list[dict[str, Any] | None],
            algo: str = "xxh3_64") -> None:
        """Send this rank's record of ``step`` (``slot``, ``length`` bytes, its gradient ``entries``, checksums
        ``algo``) to the targets, and store the sources' records of their latest step."""
        own = memoryview(self.slot(self.name(self.rank, slot), length).map)[:length]
        try:
            self._run(slot, step, length, entries, own, algo)
        finally:
            own.release()

    def skip(self, algo: str = "xxh3_64") -> None:
        """This rank has no record of the step its peers replicate now (its ``record`` failed): the exchange goes
        on with nothing sent (announced as slot 0, step -1, 0 bytes, no gradients), the sources' records received
        and stored as usual, so that every rank's exchanges stay in step with its peers'."""
        self._run(0, -1, 0, [], memoryview(b""), algo)

    def _run(self, slot: int, step: int, length: int, entries: list[dict[str, Any] | None],
             own: memoryview, algo: str) -> None:
        rows = _rows(entries, own, algo)
        head = {s: torch.zeros(4, dtype=torch.int64) for s in self.sources}
        self._swap([(t, torch.tensor([slot, step, length, len(entries)])) for t in self.targets],
                   list(head.items()), 0)
        theirs = {s: torch.zeros((_announced(s, h), 4), dtype=torch.int64) for s, h in head.items()}
        self._swap([(t, rows) for t in self.targets], list(theirs.items()), 1)
        mine = rows.tolist()        # (lists from here: a tensor's elements one by one cost microseconds each)
        heads = {s: h.tolist() for s, h in head.items()}
        listed = {s: t.tolist() for s, t in theirs.items()}
        masks = {s: self._mask(s, heads[s][1], heads[s][2], listed[s], step, mine) for s in self.sources}
        got = {t: torch.zeros(len(entries), dtype=torch.uint8) for t in self.targets}
        self._swap([(s, torch.tensor(m, dtype=torch.uint8)) for s, m in masks.items()], list(got.items()), 2)
        sends, recvs = [], []
        for t in self.targets:
            spans = _ranges(length, mine, got[t].tolist())
            buf = self._buffer("send", t, sum(n for _, n in spans))
            view, pos = memoryview(buf.numpy()), 0
            for off, n in spans:
                view[pos:pos + n] = own[off:off + n]
                pos += n
            sends.append((t, buf))
        spans_of = {s: _ranges(heads[s][2], listed[s], masks[s]) for s in self.sources}
        for s in self.sources:
            recvs.append((s, self._buffer("recv", s, sum(n for _, n in spans_of[s]))))
        self._swap(sends, recvs, 3)
        self.saved_bytes = sum(r[1] for t in self.targets for r, m in zip(mine, got[t].tolist(), strict=True)
                               if m and r[1] > 0)
        for s, buf in recvs:
            if heads[s][2] == 0:
                continue                    # (no record of the step there: ``skip``)
            self._store(s, heads[s], listed[s], masks[s], spans_of[s], buf, slot, step, mine, own)

    def _swap(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], tag: int) -> None:
        works = [self.coord.isend(t, r, tag) for r, t in sends if t.numel()]
        works += [self.coord.irecv(t, r, tag) for r, t in recvs if t.numel()]
        for w in works:
            w.wait()

    def _mask(self, src: int, step: int, length: int, theirs: list[list[int]], own_step: int,
              rows: list[list[int]]) -> list[int]:
        """Which of ``src``'s gradients (its rows ``theirs``) this rank's own record of the same step (its rows
        ``rows``) holds: 1 (not to be sent) or 0, one per row of ``theirs``."""
        mask = [0] * len(theirs)
        if step != own_step or len(theirs) != len(rows) or not _valid(theirs, length):
            return mask
        differs = []
        for i, (a, b) in enumerate(zip(theirs, rows, strict=True)):
            if a[1] <= 0 or (src, i) in self.diverged:
                continue
            if a[1:] == b[1:]:
                mask[i] = 1
                self.matched.add((src, i))
            elif a[1] == b[1]:
                differs.append(i)
                self.diverged.add((src, i))
        if differs and not self.warned and (any(mask) or any((src, i) in self.matched for i in differs)):
            self.warned = True
            warnings.warn(f"liferaft: the gradients #{differs[:8]} of rank {src} at step {step} differ from this "
                          f"rank's (rank {self.rank}) although others are the same: the per-step log sends them "
                          "to the peer in full from now on (check that the ranks are data parallel for them)",
                          stacklevel=2)
        return mask

    def _store(self, src: int, head: list[int], theirs: list[list[int]], mask: list[int],
               spans: list[tuple[int, int]], buf: torch.Tensor, own_slot: int, own_step: int,
               rows: list[list[int]], own: memoryview) -> None:
        """Write ``src``'s record into its replica slot: the prologue zeroed, the held trailer (or its magic
        zeroed: no gradient held), the received spans (everything but the held gradients), the prologue last.
        (More runs than a trailer may name: they are copied from ``own`` instead, and the replica is whole.)"""
        length = head[2]
        held = [(rows[i][0], a[0], a[1]) for i, (a, m) in enumerate(zip(theirs, mask, strict=True)) if m]
        runs = _runs(held, gap=0)               # exact: the padding between gradients is the sender's, received
        copy = len(runs) > MAX_HELD_RUNS
        trailer = held_trailer(own_step, src, self.rank, own_slot, runs) if runs and not copy else bytes(len(HELD))
        holes = [] if copy else [(d_off, n) for _, d_off, n in runs]      # (never written: no memory kept)
        dst_slot = self.slot(self.name(src, head[0]), length + len(trailer), holes)
        dst = memoryview(dst_slot.map)
        try:
            dst[:PROLOGUE] = bytes(PROLOGUE)
            dst_slot.punch(holes)           # (after the prologue: the record there before is no record now)
            dst[length:length + len(trailer)] = trailer
            for s_off, d_off, n in runs if copy else ():
                dst[d_off:d_off + n] = own[s_off:s_off + n]     # (rows checked by _valid and _rows)
            view, pos = memoryview(buf.numpy()), 0
            prologue = b""
            for off, n in spans:
                part, pos = view[pos:pos + n], pos + n
                if off < PROLOGUE:          # the first span starts with the prologue: written last
                    prologue = bytes(part[:PROLOGUE - off])
                    part, off = part[PROLOGUE - off:], PROLOGUE
                if len(part):
                    dst[off:off + len(part)] = part
            dst[:len(prologue)] = prologue
        finally:
            dst.release()


__all__ = ["Sender"]
