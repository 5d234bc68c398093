"""Which older checkpoints an incremental save is worth referencing (pure; the same answer on every rank).

A reference to an older checkpoint keeps that whole checkpoint on storage for as long as the new one is kept.
That is worth it when the chunks taken from it are a real share of the new checkpoint's bytes (frozen weights,
LoRA bases), not when they are crumbs (a pooler that got no gradient, embedding rows of tokens never seen):
then the new checkpoint copies those chunks into itself and no longer depends on the old one, so retention can
free it (docs/MANAGER.md, "Incremental saves"). Every rank runs :func:`crumb_sources` on the stored chunks all
ranks exchanged after writing, so all take the same decision without another collective.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from liferaft.planning.save_plan import WriteItem

#: Default ``SaveOptions.reference_min_share``: an older checkpoint is referenced only when the chunks taken from
#: it are at least this share of the new checkpoint's tensor bytes (measured: benchmarks/bench_write_less.py).
DEFAULT_MIN_SHARE = 0.1


def sibling_of(file: str) -> str | None:
    """The checkpoint named by a reference ``../<name>/...``; None for a file of the checkpoint itself."""
    return file[3:].partition("/")[0] if file.startswith("../") else None


def crumb_sources(writes: Sequence[Sequence[WriteItem]], stored: Sequence[Sequence[Any]],
                  min_share: float) -> frozenset[str]:
    """The sibling checkpoints whose referenced chunks the save should copy instead: those from which the
    chunks taken amount to less than ``min_share`` of the save's tensor bytes.

    ``stored[rank][i]`` describes how ``writes[rank][i]`` was stored (``file``: the checkpoint's own data file or
    ``../<sibling>/...``; ``delta``: the record an XOR delta was taken against, or None). A sibling that holds
    the base of an XOR delta (``SaveOptions.delta``) stays referenced: the delta needs its bytes by design.
    """
    total = sum(w.length for items in writes for w in items)
    taken: dict[str, int] = {}
    delta_bases: set[str] = set()
    for items, chunks in zip(writes, stored):
        for w, sc in zip(items, chunks):
            src = sibling_of(sc.file)
            if src is not None:
                taken[src] = taken.get(src, 0) + w.length
            if sc.delta is not None and (base := sibling_of(sc.delta.file)) is not None:
                delta_bases.add(base)
    return crumbs_of(taken, total, min_share, delta_bases)


def crumbs_of(taken: Mapping[str, int], total: int, min_share: float,
              delta_bases: Collection[str] = ()) -> frozenset[str]:
    """The rule itself, on totals: the siblings that gave less than ``min_share`` of ``total`` bytes (``taken``:
    bytes taken from each sibling the save references, zero-length chunks included), except those holding the
    base of an XOR delta. Nothing when ``total`` is 0 or the share is off. ``crumb_sources`` applies it to
    gathered records; ``core.base.crumbs`` to sums all-reduced over the ranks."""
    if total == 0 or min_share <= 0:
        return frozenset()
    return frozenset(s for s, n in taken.items() if n < min_share * total and s not in delta_bases)


__all__ = ["DEFAULT_MIN_SHARE", "crumb_sources", "crumbs_of", "sibling_of"]
