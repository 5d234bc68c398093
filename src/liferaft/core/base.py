"""The base of an incremental save (``SaveOptions.incremental_base``, docs/FORMAT.md §4.2): opened by rank 0 and
given to the ranks as each needs it.

A save planned gathered sends every rank rank 0's whole manifest of the base (``full_base``). A save each rank
plans on its own (``core.phases``) does not: rank 0 opens the base's index only, broadcasts what every rank
needs (``shared_base``: the tensors with the chunks the index lists, of the tensors held whole, and the files
those lie in) and sends each rank its own part (``split_base``: its chunk table's reference and the sizes of the
files bearing its rank's number), and each rank reads its own table of the base (``rank_base``). A rank of a
job whose layout is unchanged writes the same boxes as at the base, which its table lists; what a rank receives
does not grow with the world. Once every rank has written, one all-reduce sums the bytes taken from each older
checkpoint (``crumbs``), so that all ranks take the same decision on copying crumbs
(``planning.references``) without exchanging records (``copy_own_crumbs``); a save planned gathered decides
from the records every rank sent (``copy_gathered_crumbs``).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from liferaft.codecs import registry as codec_registry
from liferaft.core.commit import open_checkpoint, read_tables
from liferaft.dist import Coordinator
from liferaft.errors import LiferaftError
from liferaft.format.manifest import Manifest, TableRef
from liferaft.options import SaveOptions
from liferaft.planning.references import crumbs_of, sibling_of
from liferaft.storage import Storage

#: a file of rank N, as a file of the base names it (``data/<id>/rN.bin``, ``...-copies.bin``, ``...-chunks.json``),
#: possibly in an older checkpoint (``../<name>/data/...``)
_RANK_FILE = re.compile(r"/r(\d{5,})(?:-copies\.bin|-chunks\.json|\.bin)$")


def open_base(storage: Storage, name: str, tables: bool = True) -> tuple[str, Manifest] | None:
    """The committed manifest of the incremental save's base ``name`` (a sibling of ``storage``; ``tables``
    False: a version 4+ base's index only, its chunk tables unread); None (with a warning: the save is then a
    full one) when it cannot be opened."""
    try:
        return name, open_checkpoint(storage.sibling(name), tables=tables)
    except (LiferaftError, OSError, NotImplementedError) as e:
        _cannot(storage, name, e)
        return None


def full_base(storage: Storage, base: tuple[str, Manifest] | None) -> tuple[str, Manifest] | None:
    """``base`` (opened with ``tables=False``) with every chunk table read, for a save planned gathered."""
    if base is None or not base[1].tabled:
        return base
    try:
        return base[0], read_tables(storage.sibling(base[0]), base[1], codec_registry.names())
    except (LiferaftError, OSError) as e:
        _cannot(storage, base[0], e)
        return None


@dataclass(frozen=True)
class SharedBase:
    """What every rank of a save planned on each rank needs of the base: its name, its index without the
    files, tables, values and containers (the tensors, with the chunks it lists inline but for XOR deltas, and
    the files those lie in), and the checkpoints its chunks lie in (``siblings``: the base and the ones it
    references)."""

    name: str
    index: Manifest
    siblings: tuple[str, ...]


def shared_base(base: tuple[str, Manifest] | None) -> SharedBase | None:
    """(Rank 0) the part of ``base`` (an index, opened with ``tables=False``) that every rank receives."""
    if base is None:
        return None
    name, index = base
    # (a chunk stored as an XOR delta is not offered: a chunk table lists none, so a save planned on each rank
    # writes it again)
    tensors = tuple(replace(t, chunks=tuple(c for c in t.chunks if c.delta is None)) for t in index.tensors)
    inline = {c.file for t in tensors for c in t.chunks}
    siblings = {name} | {s for f in index.files if (s := sibling_of(f)) is not None}
    slim = replace(index, files={f: index.files[f] for f in inline}, tensors=tensors, tables=(), values=(),
                   containers=())
    return SharedBase(name=name, index=slim, siblings=tuple(sorted(siblings)))


def split_base(base: tuple[str, Manifest] | None, world: int) -> list[tuple[TableRef | None, dict[str, int]]]:
    """(Rank 0) each rank's own part of ``base``: its chunk table's reference (None: none, or a rank beyond the
    base's world) and the sizes of the files of the base bearing its number (its data file, its copies, its
    table, and the files of older checkpoints it references with that number): O(the base's files)."""
    out: list[tuple[TableRef | None, dict[str, int]]] = [(None, {}) for _ in range(world)]
    if base is None:
        return out
    index = base[1]
    for ref in index.tables:
        if ref.rank < world:
            out[ref.rank] = (ref, out[ref.rank][1])
    for f, size in index.files.items():
        m = _RANK_FILE.search(f)
        if m is not None and int(m.group(1)) < world:
            out[int(m.group(1))][1][f] = size
    return out


def rank_base(storage: Storage, shared: SharedBase, mine: tuple[TableRef | None, dict[str, int]], rank: int
              ) -> tuple[str, Manifest]:
    """This rank's view of the base: the index's tensors with the chunks it lists inline and those of this
    rank's chunk table, and the files they lie in. The table is read and checked as a load checks it
    (``core.tabled.TableSource.check_table``: its size and digest against the index's, every chunk within its
    file, one that rank was planned to write, listed once). A table that cannot be read, fails a check or names
    a file this rank was not given (the base was saved on another layout) is left out with a warning: this rank
    then writes its chunks of sharded tensors again (never wrong, only larger)."""
    ref, files = mine
    index = replace(shared.index, files={**shared.index.files, **files}, tables=(ref,) if ref is not None else ())
    if ref is None:
        return shared.name, index
    try:
        from liferaft.core.tabled import TableSource

        records = TableSource(storage.sibling(shared.name), index, codec_registry.names()).check_table(ref.rank)
    except (LiferaftError, OSError, KeyError) as e:     # (KeyError: a file the index lists but not to this rank)
        warnings.warn(f"{storage.url}: rank {rank}: the chunk table {ref.file!r} of incremental base "
                      f"{shared.name!r} cannot be used ({e}); this rank writes its chunks of sharded tensors "
                      "again", stacklevel=3)
        return shared.name, index
    chunks: list[list[Any]] = [list(t.chunks) for t in index.tensors]
    for pos, rec in records:
        chunks[pos].append(rec)
    tensors = tuple(replace(t, chunks=tuple(c)) for t, c in zip(index.tensors, chunks))
    return shared.name, replace(index, tensors=tensors)


def crumbs(coord: Coordinator, shared: SharedBase, wrote: int, stored: Sequence[Any] | None, min_share: float,
           failed: bool) -> tuple[bool, frozenset[str]]:
    """(Every rank, after writing) one all-reduce of the bytes each rank wrote and took from each checkpoint of
    ``shared.siblings`` (``stored``: this rank's ``StoredChunk``s, None when its write failed): whether some
    rank failed, and the checkpoints whose chunks amount to less than ``min_share`` of the save's tensor bytes,
    to be copied instead of referenced (``planning.references.crumbs_of``, the rule ``crumb_sources`` applies
    to gathered records, here on the sums)."""
    pos = {s: i for i, s in enumerate(shared.siblings)}
    taken = [0] * (2 * len(pos))                # bytes taken from each sibling, then how many chunks
    for sc, n in stored or ():
        i = pos.get(sibling_of(sc.file) or "")
        if i is not None:
            taken[i] += n
            taken[len(pos) + i] += 1
    sums = coord.all_sum([int(failed), wrote, *taken], "save (incremental references)")
    if sums[0]:
        return True, frozenset()
    n = len(pos)
    referenced = {s: sums[2 + i] for i, s in enumerate(shared.siblings) if sums[2 + n + i]}
    return False, crumbs_of(referenced, sums[1], min_share)


def copy_gathered_crumbs(coord: Coordinator, prep: Any, stored: list[Any], opts: SaveOptions
                 ) -> tuple[list[Any], list[tuple[int, int]]]:
    """After every rank wrote: the chunks referenced from a sibling checkpoint that provides less than
    ``opts.reference_min_share`` of the save's bytes are copied into it instead (each rank its own, then one
    exchange), so that the save does not keep that checkpoint alive for crumbs (``planning.references``). Every
    rank decides from the same exchanged records, so all agree on whether this runs. Returns the stored chunks
    and, per rank, (stored bytes copied, raw bytes no longer referenced)."""
    from liferaft.core.chunks.rehome import copy_references
    from liferaft.format.layout import copies_file_name
    from liferaft.planning.references import crumb_sources

    none = [(0, 0)] * coord.world
    if opts.reference_min_share <= 0 or not any(sc.file.startswith("../") for s in stored for sc in s[0]):
        return stored, none
    sources = crumb_sources(prep.plan.writes, [s[0] for s in stored], opts.reference_min_share)
    if not sources:
        return stored, none
    t0 = time.perf_counter()

    def copy() -> tuple[Any, ...]:
        chunks, copied, raw = copy_references(prep.storage, prep.save_id, prep.rank, prep.writes,
                                              stored[prep.rank][0], sources, prep.policy.dtypes, opts.alignment)
        if copied:
            prep.copies = copies_file_name(prep.save_id, prep.rank)
        return chunks, stored[prep.rank][1], copied, raw

    gathered = coord.run(copy, "save (copy referenced chunks)", cleanup=prep.abandon)
    prep.timings["copy"] = time.perf_counter() - t0
    return [(g[0], g[1]) for g in gathered], [(g[2], g[3]) for g in gathered]


def copy_own_crumbs(coord: Coordinator, prep: Any, result: Any, error: BaseException | None, opts: SaveOptions
                    ) -> tuple[Any, BaseException | None, int, int]:
    """After this rank wrote (``result``, or its ``error``) a save planned on each rank with a base
    (``prep.base``): the decision of ``crumbs`` (every rank takes part, also one whose write failed), then this
    rank's chunks taken from the crumbs' checkpoints copied into its file of copies. Returns the result with its
    chunks updated, the error (a failed copy's), and the stored bytes copied and raw bytes no longer referenced."""
    from liferaft.core.chunks.rehome import copy_references
    from liferaft.format.layout import copies_file_name

    taken = None if result is None else [(sc, w.length) for w, sc in zip(prep.writes, result.chunks)]
    failed, sources = crumbs(coord, prep.base, sum(w.length for w in prep.writes), taken, opts.reference_min_share,
                             error is not None)
    if not sources or failed or result is None:
        return result, error, 0, 0
    try:
        chunks, copied, raw = copy_references(prep.storage, prep.save_id, prep.rank, prep.writes, result.chunks,
                                              sources, prep.policy.dtypes, opts.alignment)
    except BaseException as e:  # noqa: BLE001 - reported to every rank by the caller
        return result, e, 0, 0
    if copied:
        prep.copies = copies_file_name(prep.save_id, prep.rank)
    return replace(result, chunks=chunks), error, copied, raw


def _cannot(storage: Storage, name: str, e: BaseException) -> None:
    warnings.warn(f"{storage.url}: incremental base {name!r} cannot be used ({e}); saving every chunk", stacklevel=4)
