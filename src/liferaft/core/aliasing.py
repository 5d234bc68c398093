"""Load destinations that share memory across keys, or whose own elements do (``check_writable``): refused before
any byte is copied.

Two keys whose destinations partially overlap (``b = base[0:6]``, ``c = base[2:6]``) would each be written in turn,
the later one over the earlier: the load would succeed with one of them wrong. Tied tensors — the very same view
under two keys (same storage, offset, shape, strides and dtype: tied embeddings) — are returned by
``check_disjoint`` and must hold equal values in the checkpoint (``check_tied``: an untied checkpoint loaded into a
tied model would otherwise leave one key's values silently in both); views that interleave without sharing an element (``base[0::2]``, ``base[1::2]``) are
fine. Two boxes of one key (a ``Sharded``'s parts) hold different parts of the global tensor: any memory they
share is refused, even the very same view. Near-linear: destinations grouped by storage, sorted by the byte
extent they span, and only those whose extents intersect compared, exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from liferaft.errors import InvalidStateError, StateMismatchError

#: (key, box number) of two keys whose destinations are the very same view
Tied = tuple[tuple[str, int], tuple[str, int]]

#: Elements up to which two interleaved destinations are compared element by element; larger ones whose byte
#: extents intersect (and which are not the same view) are refused rather than guessed.
EXACT_ELEMENTS = 1 << 26


def _extent(t: torch.Tensor) -> tuple[int, int]:
    es = t.element_size()
    lo = t.storage_offset() * es
    return lo, lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * es


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The storage byte offsets of every byte of ``t``'s elements."""
    es = t.element_size()
    offs = torch.full((), t.storage_offset() * es, dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        offs = (offs.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (st * es)).reshape(-1)
    return (offs.unsqueeze(-1) + torch.arange(es, dtype=torch.int64)).reshape(-1)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset(), tuple(a.shape), a.stride(), a.dtype) == \
        (b.storage_offset(), tuple(b.shape), b.stride(), b.dtype)


def _share(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() + b.numel() > EXACT_ELEMENTS:
        return True
    return bool(torch.isin(_bytes(a), _bytes(b)).any())


def check_disjoint(dests: Iterable[tuple[str, int, torch.Tensor]]) -> list[Tied]:
    """InvalidStateError naming both keys when the destinations of two different keys share memory without being
    the same view, or two boxes of one key (a ``Sharded`` with ``more`` boxes: different parts of the global
    tensor) share any memory (module docstring). ``dests``: (key, box number, local tensor) of every tensor the
    load fills in place. Returns the pairs of different keys whose destinations are the very same view (tied)."""
    tied: list[Tied] = []
    groups: dict[tuple[str, int], list[tuple[int, int, str, int, torch.Tensor]]] = {}
    for key, box, t in dests:
        if t.numel() == 0:
            continue
        lo, hi = _extent(t)
        groups.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append((lo, hi, key, box, t))
    for items in groups.values():
        if len(items) < 2:
            continue
        items.sort(key=lambda x: (x[0], x[1]))
        active: list[tuple[int, int, str, int, torch.Tensor]] = []
        for lo, hi, key, box, t in items:
            active = [a for a in active if a[1] > lo]
            for _, _, other, other_box, u in active:
                if other == key and other_box != box and _share(t, u):
                    raise InvalidStateError(
                        f"key {key!r}: two of its boxes (parts {other_box} and {box} of the Sharded) share memory "
                        f"(shape {list(u.shape)} at storage offset {u.storage_offset()} and shape {list(t.shape)} at "
                        f"{t.storage_offset()}), so one would overwrite the other; nothing was loaded. Give each box "
                        "its own tensor")
                if other != key and _same_view(t, u):
                    tied.append(((other, other_box), (key, box)))
                elif other != key and _share(t, u):
                    raise InvalidStateError(
                        f"keys {other!r} and {key!r}: their destinations share memory (views of one tensor that "
                        f"overlap: shape {list(u.shape)} at storage offset {u.storage_offset()} and shape "
                        f"{list(t.shape)} at {t.storage_offset()}), so one would overwrite the other; nothing was "
                        "loaded. Load into separate tensors (e.g. .clone() them into the state), or tie them as "
                        "the very same tensor")
            active.append((lo, hi, key, box, t))
    return tied


def _signature(entry: Any) -> list[tuple[Any, ...]] | None:
    """A liferaft tensor entry's chunks as (box, block hashes, digest), sorted; None when that cannot prove
    equality (no chunks listed yet, lossy, not covering the tensor)."""
    chunks = getattr(entry, "chunks", None)
    if not chunks or getattr(entry, "lossy", None):
        return None
    count = 1
    for n in entry.shape:
        count *= n
    covered = 0
    for c in chunks:
        k = 1
        for n in c.sizes:
            k *= n
        covered += k
    if covered != count:
        return None
    return sorted((tuple(c.offsets), tuple(c.sizes), tuple(c.hashes), c.digest) for c in chunks)


def check_tied(reader: Any, tied: Sequence[Tied], boxes: Mapping[tuple[str, int], tuple[Sequence[int], Any]]) -> None:
    """StateMismatchError naming both keys when two keys the state ties (the very same tensor) hold different
    values in the checkpoint (only one of them could be loaded). Proven equal by a liferaft checkpoint's chunk
    hashes where both keys are stored alike (a tied model's save), else by reading both boxes (``boxes``:
    (key, box number) → (global offsets, the local destination)) into temporaries and comparing their bytes."""
    entries = getattr(reader, "entries", None)
    for (ka, ia), (kb, ib) in tied:
        if isinstance(entries, Mapping):
            sa, sb = _signature(entries.get(ka)), _signature(entries.get(kb))
            if sa is not None and sa == sb:
                continue
        (oa, dest), (ob, _) = boxes[(ka, ia)], boxes[(kb, ib)]
        a = torch.empty(tuple(dest.shape), dtype=dest.dtype)
        b = torch.empty(tuple(dest.shape), dtype=dest.dtype)
        reader.copy_box(ka, oa, a)
        reader.copy_box(kb, ob, b)
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            raise StateMismatchError(
                f"keys {ka!r} and {kb!r} are one tensor in the state (tied), but the checkpoint holds different "
                "values for them: only one could be loaded; nothing was loaded. Load into separate tensors (untie "
                "them), or load a checkpoint saved from the tied model")


#: Elements up to which ``has_internal_overlap`` decides an interleaved layout by listing its memory offsets.
EXACT_OVERLAP_ELEMENTS = 1 << 26


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of the strided tensor ``t`` share a memory location (an ``expand``-ed, stride-0 view,
    an overlapping ``as_strided``). With the dimensions of size > 1 sorted by stride, ``t`` is overlap-free when
    each stride is at least the extent the smaller dimensions span (``(size - 1) * stride`` each, plus one): every
    dense, permuted or sliced tensor, decided at once. A layout that fails that test may still be overlap-free
    (interleaved: shape (2, 3), strides (3, 2)); it is decided exactly by counting its distinct offsets, up to
    ``EXACT_OVERLAP_ELEMENTS`` elements (beyond, such a layout counts as overlapping: refused, not guessed)."""
    if t.numel() <= 1:
        return False
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for stride, n in dims:
        if stride == 0:
            return True
        if stride < extent:
            break
        extent += (n - 1) * stride
    else:
        return False
    if t.numel() > EXACT_OVERLAP_ELEMENTS:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    return int(torch.unique(offsets).numel()) != t.numel()


def check_writable(key: str, t: torch.Tensor) -> None:
    """InvalidStateError naming ``key`` unless a load can copy into ``t`` in place: a strided tensor with data
    (not on the meta device), not an inference tensor, no two elements sharing memory. Run for every destination
    before any byte is copied, so a refusal leaves the whole state unchanged."""
    fix = "; nothing was loaded. Load into a tensor that owns its memory (e.g. .clone() it into the state)"
    if t.is_meta:
        raise InvalidStateError(f"key {key!r}: the destination is on the meta device and has no memory to load "
                                f"into{fix}")
    if t.layout != torch.strided:
        raise InvalidStateError(f"key {key!r}: the destination is a {t.layout} tensor; loads fill dense (strided) "
                                f"tensors{fix}")
    if t.is_inference():
        raise InvalidStateError(f"key {key!r}: the destination is an inference tensor (made under "
                                f"torch.inference_mode()), which cannot be updated in place{fix}")
    if has_internal_overlap(t):
        raise InvalidStateError(f"key {key!r}: the destination has elements sharing memory (an expand()-ed or "
                                f"overlapping as_strided view: shape {list(t.shape)}, stride {list(t.stride())}), "
                                f"so it cannot be written in place{fix}")
