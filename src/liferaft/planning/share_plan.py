"""Read sharing: a byte range that several ranks need is read from storage by one of them and sent to the others.

Pure functions on the read spans ``(file, offset, length)`` every rank planned. Typical cases: every data-parallel
rank loading the same replicated tensors (one read per span instead of one per rank), and resharding that makes
all ranks read the same hash blocks (Shard(0) → Shard(1): every rank needs every row). Only identical spans are
shared (load planning cuts a chunk the same way on every rank that wants the same blocks); spans smaller than
``min_bytes`` are read locally, where one more small read costs less than a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from liferaft.errors import CorruptCheckpointError

Span = tuple[str, int, int]          # (file, byte offset, length)

MIN_SHARED_BYTES = 1 << 20            # the least span shared over the process group (one message per span)
MIN_HOST_SHARED_BYTES = 0             # the least shared through a host's memory (a 40-byte notice per span)
RUN_GAP = 256 << 10                  # spans this close continue a run (``plan_sharing``): the bytes between
                                     # (small spans, read locally) are read with the run and not used


@dataclass(frozen=True)
class SharedSpan:
    """A span (the bytes ``[start, start + length)`` of its file) read by ``reader`` and sent to ``receivers``;
    ``tag`` numbers the transfers in file order, the same on every rank."""

    tag: int
    reader: int
    receivers: tuple[int, ...]
    start: int
    length: int


def plan_sharing(spans_per_rank: Sequence[Sequence[Span]], min_bytes: int = MIN_SHARED_BYTES,
                 holders: Mapping[str, Sequence[int]] | None = None, run_bytes: int = 0) -> dict[Span, SharedSpan]:
    """Which spans are shared, who reads each and who receives it; the same result on every rank.

    Spans needed by two or more ranks and at least ``min_bytes`` long are shared; each goes to the rank that
    needs it with the fewest bytes assigned so far (in file order, ties to the lower rank), so that the ranks
    read in turn, all at the same time. Every rank sends and receives in tag (file) order, so the transfers
    cannot deadlock. With ``run_bytes``, a run of consecutive shared spans of one file (each starting at most
    ``RUN_GAP`` bytes past the previous one's end) needed by the same ranks, of at most ``run_bytes`` in all, goes
    to one reader, chosen at the run's first span: its reader may read the run with one large request instead
    of many small ones in turn with its peers (a resharding load's spans are single chunks of a few MiB).

    ``holders`` maps a file to the only ranks that can read it (a memory tier's node-local files; a file not
    named: every rank). A span needed by a rank that cannot read its file is always shared, whatever its length:
    read by a holder (one that needs it too if there is one, else the holder with the fewest bytes assigned so
    far; such a reader may need none of it) and sent to the ranks that need it. A span no holder can read raises
    CorruptCheckpointError (the caller lists holders only for files some rank holds).
    """
    needers: dict[Span, list[int]] = {}
    for rank, spans in enumerate(spans_per_rank):
        for span in set(spans):
            needers.setdefault(span, []).append(rank)
    load = [0] * len(spans_per_rank)
    out: dict[Span, SharedSpan] = {}
    run: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None     # (file, needers, able) of the open run
    run_end = run_len = run_reader = 0
    for span in sorted(needers):
        ranks = sorted(needers[span])
        readable = holders.get(span[0]) if holders is not None else None
        able = ranks if readable is None else [r for r in ranks if r in readable]
        if readable is not None and len(able) < len(ranks):          # someone must get it from a holder
            if not able:
                able = sorted(set(readable))
            if not able:
                raise CorruptCheckpointError(f"data file {span[0]!r}: no rank holds it, so bytes {span[1]}.."
                                             f"{span[1] + span[2]} cannot be read; restore from another copy")
        elif len(ranks) < 2 or span[2] < min_bytes:
            continue
        key = (span[0], tuple(ranks), tuple(able))
        if run_bytes and run == key and span[1] <= run_end + RUN_GAP and run_len + span[2] <= run_bytes:
            reader, run_len, run_end = run_reader, run_len + span[2], max(run_end, span[1] + span[2])
        else:
            reader = min(able, key=lambda r: (load[r], r))
            run, run_reader, run_len, run_end = key, reader, span[2], span[1] + span[2]
        load[reader] += span[2]
        out[span] = SharedSpan(tag=len(out), reader=reader, receivers=tuple(r for r in ranks if r != reader),
                               start=span[1], length=span[2])
    return out
