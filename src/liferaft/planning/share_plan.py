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

MIN_SHARED_BYTES = 1 << 20            # the least span shared on its own (``plan_sharing``)
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
                 holders: Mapping[str, Sequence[int]] | None = None, run_bytes: int = 0,
                 decoded: Mapping[Span, int] | None = None) -> dict[Span, SharedSpan]:
    """Which spans are shared, who reads each and who receives it; the same result on every rank.

    Spans needed by two or more ranks and at least ``min_bytes`` long are shared; each goes to the rank that
    needs it with the fewest bytes assigned so far (in file order, ties to the lower rank), so that the ranks
    read in turn, all at the same time. Every rank sends and receives in tag (file) order, so the transfers
    cannot deadlock. With ``run_bytes``, a run of consecutive shared spans of one file (each starting at most
    ``RUN_GAP`` bytes past the previous one's end) needed by the same ranks, of at most ``run_bytes`` in all, goes
    to one reader, chosen at the run's first span: its reader may read the run with one large request instead
    of many small ones in turn with its peers (a resharding load's spans are single chunks of a few MiB); then
    a span shorter than ``min_bytes`` is shared too when it belongs to a chain of adjacent spans (each at most
    ``RUN_GAP`` from the ones before it, needed by the same ranks) of at least ``min_bytes`` in all
    (``_joining``): the biases and small weights between a resharded model's large chunks ride in their runs, and
    so does a checkpoint saved in small chunks, while a small replicated span among chunks only one rank needs (a
    0-dim step between row shards) stays in its rank's own coalesced reads.
    ``decoded`` gives the bytes of an encoded span once decoded where that is more (it counts for ``min_bytes``).

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
    size = {span: max(span[2], (decoded or {}).get(span, 0)) for span in needers}
    joined = _joining(needers, size, min_bytes) if run_bytes else set()
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
        elif len(ranks) < 2 or size[span] < min_bytes and span not in joined:
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


def _joining(needers: Mapping[Span, list[int]], size: Mapping[Span, int], min_bytes: int) -> set[Span]:
    """The spans of ``size`` below ``min_bytes`` in a chain of at least ``min_bytes`` in all: spans needed by the
    same two or more ranks, each starting at most ``RUN_GAP`` past the end of the ones before it (a chain that
    holds a long span, or many short ones: a checkpoint saved in small chunks)."""
    out: set[Span] = set()
    chain: list[Span] = []
    total = end = 0

    def close() -> None:
        if total >= min_bytes:
            out.update(s for s in chain if size[s] < min_bytes)
    for span in sorted(s for s, ranks in needers.items() if len(ranks) >= 2):
        if chain and span[0] == chain[-1][0] and sorted(needers[span]) == sorted(needers[chain[-1]]) \
                and span[1] <= end + RUN_GAP:
            chain.append(span)
            total, end = total + size[span], max(end, span[1] + span[2])
        else:
            close()
            chain, total, end = [span], size[span], span[1] + span[2]
    close()
    return out
