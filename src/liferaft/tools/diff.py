"""``diff``: compare two checkpoints key by key, streaming (docs/cli/diff.md).

Tensors are compared in slabs of leading-dimension rows (at most ``slab_bytes`` per side in memory), read and
verified like any load, whatever the layouts the two were saved in; plain values are compared decoded, exactly
(``value_difference``: ``True``, ``1`` and ``1.0`` differ, arrays by dtype, shape and bits), except, where a side
is a format that does not record container types (not liferaft), for the container shapes such formats rebuild
(list or tuple, int or string dict keys, DCP's flattened leaves). Either side
may be any format ``core.open.open_reader`` opens (both read through the reader protocol); B's keys can be renamed
(or put under a prefix) to match A's. Useful to check that a resume or a conversion was exact, or how far two
steps drifted apart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from liferaft.core.open import in_call, open_reader
from liferaft.errors import OptionsError
from liferaft.formats.base import Reader, check_patterns, matches
from liferaft.options import LoadOptions, check_int, check_number, check_options, check_path
from liferaft.state.dtypes import torch_dtype
from liferaft.tools._slabs import itemsize, read_box, slabs
from liferaft.tools._values import (  # noqa: F401 - the API of this module too
    MAX_VALUE_DEPTH,
    ValueTooDeepError,
    _bits,
    _plain_tensor,
    same_value,
    value_difference,
)

#: Tensors of at most this many bytes are read in batches (one read job for up to ``BATCH_KEYS`` of them, at most
#: ``slab_bytes`` a batch): a checkpoint of 100,000 small tensors is compared in seconds, not one job per key.
SMALL_TENSOR = 1 << 20
BATCH_KEYS = 4096


@dataclass(frozen=True)
class KeyDiff:
    """One key: ``status`` "added" (only in B), "removed" (only in A), "changed", "equal" or "mismatch" (shape,
    dtype or kind differ); for tensors the largest absolute and relative (to |a|) difference."""

    key: str
    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class DiffReport:
    """The comparison of checkpoints ``a`` and ``b``: one ``KeyDiff`` per key of either, in order."""

    a: str
    b: str
    keys: tuple[KeyDiff, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        """Every key is in both and equal."""
        return all(k.status == "equal" for k in self.keys)

    def changed(self) -> list[KeyDiff]:
        """The keys that are not equal (added, removed, changed or mismatched), in order."""
        return [k for k in self.keys if k.status != "equal"]


def _exact(dtype: torch.dtype) -> bool:
    """Integer and bool tensors are equal only when every element is: ``--tolerance`` is for float drift."""
    return not (dtype.is_floating_point or dtype.is_complex)


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max |a − b|, max |a − b| / |a|, bit-identical). The bits are the verdict; the two figures are information
    (and what ``--tolerance`` bounds, for float tensors only). Integer differences are exact (taken in uint64, so
    nothing rounds above 2**53 and nothing overflows); float ones are taken in float64, NaNs at the same places
    counting as no difference — so bits that differ can show a difference of 0 (``-0.0`` vs ``0.0``, NaN
    payloads): the verdict stays "changed"."""
    a, b = _plain_tensor(a), _plain_tensor(b)
    if torch.equal(_bits(a), _bits(b)):
        return 0.0, 0.0, True
    if _exact(a.dtype):
        import numpy as np

        x = (a.to(torch.uint8) if a.dtype == torch.bool else a).numpy()
        y = (b.to(torch.uint8) if b.dtype == torch.bool else b).numpy()
        d = np.maximum(x, y).astype(np.uint64) - np.minimum(x, y).astype(np.uint64)   # mod 2**64: exact
        rel = d.astype(np.float64) / np.maximum(np.abs(x.astype(np.float64)), 1e-30)
        return (float(int(d.max())) if d.size else 0.0, float(rel.max()) if rel.size else 0.0, False)
    wide = torch.complex128 if a.is_complex() else torch.float64
    a64, b64 = a.to(wide), b.to(wide)
    d = (a64 - b64).abs()
    if not a.is_complex():
        d = torch.where(torch.isnan(a64) & torch.isnan(b64), torch.zeros_like(d), d)
    d = torch.nan_to_num(d, nan=float("inf"), posinf=float("inf"))       # (+inf vs -inf, NaN vs a number: inf)
    rel = torch.nan_to_num(d / a64.abs().clamp_min(1e-30), nan=float("inf"), posinf=float("inf"))
    return (float(d.max()) if d.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0, False)


@dataclass
class _Side:
    """One side of a diff: its reader, and in the names the diff compares (A's) its tensors (name → the reader's
    key) and its plain values (name → decoded when called). ``renamed``: the names are not the reader's keys."""

    reader: Reader
    tensors: dict[str, str]
    values: dict[str, Callable[[], Any]]
    renamed: bool = False


def _side(reader: Reader, rename: Callable[[str], str] | None = None) -> _Side:
    """The keys of ``reader`` under their names (``rename``d when given: two keys to one name is an OptionsError);
    ``_select`` then keeps those ``keys`` select."""
    names = {k: rename(k) if rename else k for k in reader.keys}
    if rename and len(set(names.values())) != len(names):
        raise OptionsError(f"{reader.url}: the renaming maps two keys to one name")
    return _Side(reader, {names[k]: k for k in reader.tensors},
                 {names[k]: (lambda k=k: reader.value(k)) for k in reader.values}, renamed=rename is not None)


def _only(side: _Side, keys: Sequence[str]) -> None:
    """Keep only the names ``keys`` select."""
    side.tensors = {n: k for n, k in side.tensors.items() if matches(n, keys)}
    side.values = {n: v for n, v in side.values.items() if matches(n, keys)}


def _regroup(mine: _Side, other: _Side) -> dict[str, list[str]]:
    """DCP stores each leaf of a nested plain value on its own ("sched.lr", "optim.param_groups.0.lr"), liferaft the
    value whole ("sched"): leaves under a value key the other side holds whole are compared as that one nested
    value (rebuilt by the nesting DCP recorded, else by the dots of the keys; ``same_value`` then compares it by
    value, whatever container shape the rebuilding chose). Not on a renamed side (its names are not the keys
    the reader knows the parts by). Returns the values rebuilt, with the names of their parts."""
    joined: dict[str, list[str]] = {}
    if mine.renamed:
        return joined
    reader = mine.reader
    for key in [k for k in other.values if k not in mine.values and k not in mine.tensors]:
        under = [k for k in reader.value_parts(key) if k in mine.values]
        if under:
            for k in under:
                mine.values.pop(k)
            mine.values[key] = lambda key=key, under=under: reader.joined_value(key, under)
            joined[key] = under
    return joined


def _select(sides: Sequence[_Side], keys: Sequence[str] | None, parts: dict[str, list[str]]) -> None:
    """Keep on every side the names ``keys`` select (``formats.base.matches``) — where a pattern selects leaves of
    a plain value that a side holds whole (``opt.nested`` or ``opt.nested.*`` of a value ``opt`` liferaft keeps
    whole and DCP split into ``opt.lr``, ``opt.nested.a``), the whole value ``opt`` on both sides, compared
    whole. ``parts``: the leaves each rebuilt value was joined from (``_regroup``)."""
    keys = check_patterns(keys)
    if not keys:
        return

    def chosen(name: str, value: bool) -> bool:
        return matches(name, keys) or (value and (any(p.startswith(name + ".") for p in keys)
                                                  or any(matches(k, keys) for k in parts.get(name, ()))))
    names = {n for s in sides for n in s.tensors if matches(n, keys)} | \
        {n for s in sides for n in s.values if chosen(n, True)}
    every = [*{n for s in sides for n in [*s.tensors, *s.values]}, *{p for ps in parts.values() for p in ps}]
    for p in keys:                          # a pattern that selects nothing on either side is a mistake, not "equal"
        if not any(matches(n, (p,)) for n in every) and not any(n.startswith(p + ".") for n in every):
            raise OptionsError(f"key {p!r} is not in either checkpoint (no key equals it, lies under it or matches "
                               "it as a glob)")
    for s in sides:
        s.tensors = {n: k for n, k in s.tensors.items() if n in names}
        s.values = {n: v for n, v in s.values.items() if n in names}


@in_call
def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
         tolerance: float = 0.0, rename: Sequence[tuple[str, str]] | None = None, module: str | None = None,
         slab_bytes: int = 64 << 20, options: LoadOptions | None = None,
         progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``: liferaft checkpoints, or either side a Hugging Face safetensors
    folder/file, a DCP folder or a ``torch.save`` file (to check a conversion without converting back).

    Keys are matched in A's names: B's keys are first renamed by ``rename`` (``(regex, replacement)`` pairs applied
    in order, ``re.sub`` syntax), then, with ``module="KEY"``, prefixed by ``KEY.`` while A is restricted to its
    keys under ``KEY`` — so an export of one module (``convert --to hf``, keys without the prefix) is compared with
    its subtree of the source. ``keys``: keys, key prefixes or globs (in A's names) to restrict to. Tensors are "equal" when
    their bits are (``-0.0`` is not ``0.0``; integers exact at any magnitude); a float tensor whose largest
    absolute difference is ≤ ``tolerance`` (> 0) counts as "equal" too (NaNs at the same places: no difference),
    integer and bool tensors never by tolerance. Plain values are compared exactly (``value_difference``:
    ``True``, ``1`` and ``1.0`` differ). Where a side is a format that does not record container types (any but
    liferaft: DCP, ``torch.save`` and safetensors rebuild containers their own way), up to the container shapes
    formats rebuild: lists and tuples alike, int dict keys as strings, a dict keyed 0..n-1 as the list it was
    flattened from. Between two liferaft checkpoints, which store containers exactly and load them back as they
    were, not: ``{1: "x"}`` vs ``{"1": "x"}``, ``[1, 2]`` vs ``(1, 2)`` and ``{0: "a", 1: "b"}`` vs ``["a", "b"]``
    are changes. Where ``keys`` selects leaves of a plain value that one side holds whole and the other split
    into leaves (liferaft keeps ``opt`` whole, DCP stores ``opt.nested.a``), the whole value is compared."""
    from liferaft.tools.export import renamer

    check_path(a, "diff(a=...)")
    check_path(b, "diff(b=...)")
    opts = check_options(options, LoadOptions, "diff")
    check_number("diff", "tolerance", tolerance, 0)
    check_int("diff", "slab_bytes", slab_bytes, 1)
    ra = open_reader(a, opts, lazy=True)       # (chunk tables read by windows of keys: ``Reader.read_order``)
    try:
        rb = open_reader(b, opts, lazy=True)
    except BaseException:
        ra.close()
        raise
    try:
        return _diff(ra, rb, keys, tolerance, renamer(rename) if rename or module else None, module, slab_bytes,
                     progress)
    finally:
        ra.close()
        rb.close()


def _diff(ra: Reader, rb: Reader, keys: Sequence[str] | None, tolerance: float, rn: Callable[[str], str] | None,
          module: str | None, slab_bytes: int, progress: Callable[[int], None] | None) -> DiffReport:
    sa = _side(ra)
    sb = _side(rb, None if rn is None else (lambda k: f"{module}.{rn(k)}") if module else rn)
    if module:
        _only(sa, [module, f"{module}.*"])
    parts = _regroup(sa, sb) | _regroup(sb, sa)
    _select((sa, sb), keys, parts)
    lenient = not (ra.fmt == rb.fmt and ra.fmt in ("liferaft", "torch"))     # others do not record container types
    ta, tb, va, vb = sa.tensors, sb.tensors, sa.values, sb.values
    every = list(dict.fromkeys([*ta, *va, *tb, *vb]))
    both = [k for k in every if k in ta and k in tb]
    windowed = ra.read_order([ta[k] for k in both]) | rb.read_order([tb[k] for k in both])
    ra.check_present([ta[k] for k in ta if k in tb])    # the sizes the manifests claim hold, before any slab
    rb.check_present([tb[k] for k in tb if k in ta])
    out: list[KeyDiff] = []
    batch: list[tuple[int, str, tuple[int, ...], torch.dtype]] = []     # small tensors not compared yet
    batch_bytes = 0

    def settle() -> None:
        nonlocal batch_bytes
        if not batch:
            return
        shapes, dtypes = [b[2] for b in batch], [b[3] for b in batch]
        xs = _read_whole(ra, [ta[b[1]] for b in batch], shapes, dtypes)
        ys = _read_whole(rb, [tb[b[1]] for b in batch], shapes, dtypes)
        for (i, key, _, dtype), x, y in zip(batch, xs, ys):
            d_abs, d_rel, eq = _compare(x, y)
            out[i] = _verdict(key, dtype, d_abs, d_rel, eq, tolerance)
        if progress is not None:
            progress(sum(x.numel() * x.element_size() for x in xs))
        batch.clear()
        batch_bytes = 0
    for key in every:
        in_a, in_b = key in ta or key in va, key in tb or key in vb
        if not in_b:
            out.append(KeyDiff(key, "removed"))
            continue
        if not in_a:
            out.append(KeyDiff(key, "added"))
            continue
        if key in va or key in vb:
            if key in va and key in vb:
                try:
                    why = value_difference(va[key](), vb[key](), lenient=lenient)
                except ValueTooDeepError as e:
                    raise ValueTooDeepError(f"key {key!r}: {e}") from None
                out.append(KeyDiff(key, "changed", detail=why) if why else KeyDiff(key, "equal"))
            else:
                out.append(KeyDiff(key, "mismatch", detail="a tensor in one, a plain value in the other"))
            continue
        pa, pb = ra.tensors[ta[key]], rb.tensors[tb[key]]
        (da, sha, ka), (db, shb, kb) = (pa.dtype, tuple(pa.shape), pa.kind), (pb.dtype, tuple(pb.shape), pb.kind)
        kinds_differ = ka != kb and ra.fmt == rb.fmt == "liferaft"     # other formats hold numpy arrays as tensors
        if (sha, da) != (shb, db) or kinds_differ:
            out.append(KeyDiff(key, "mismatch", detail=f"{ka} {list(sha)} {da} vs {kb} {list(shb)} {db}"))
            continue
        dtype = torch_dtype(da)
        nbytes = itemsize(da) * math.prod(sha)
        if nbytes <= min(slab_bytes, SMALL_TENSOR):     # read with others: one read job per batch, not per key
            out.append(KeyDiff(key, "equal"))           # (a placeholder, settled by the batch)
            batch.append((len(out) - 1, key, sha, dtype))
            batch_bytes += nbytes
            if batch_bytes >= slab_bytes or len(batch) >= BATCH_KEYS:
                settle()
            continue
        if windowed:        # (the keys read in order: small ones before this one first)
            settle()
        max_abs = max_rel = 0.0
        equal = True
        for box in slabs(sha, itemsize(da), slab_bytes):
            x, y = read_box(ra, ta[key], box), read_box(rb, tb[key], box)
            d_abs, d_rel, eq = _compare(x, y)
            if progress is not None:
                progress(x.numel() * x.element_size())
            max_abs, max_rel, equal = max(max_abs, d_abs), max(max_rel, d_rel), equal and eq
        out.append(_verdict(key, dtype, max_abs, max_rel, equal, tolerance))
    settle()
    return DiffReport(a=ra.url, b=rb.url, keys=tuple(out))


def _verdict(key: str, dtype: torch.dtype, max_abs: float, max_rel: float, equal: bool, tolerance: float) -> KeyDiff:
    if equal or (tolerance > 0 and not _exact(dtype) and max_abs <= tolerance):
        return KeyDiff(key, "equal", max_abs, max_rel)
    why = "" if max_abs else "the same numbers, other bits: -0.0 vs 0.0 or NaN payloads"
    return KeyDiff(key, "changed", max_abs, max_rel, why)


def _read_whole(reader: Reader, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
                dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Whole small tensors ``keys`` of ``reader``, read by one read job (one pass over their files)."""
    targets = [torch.empty(shape, dtype=dt) for shape, dt in zip(shapes, dtypes)]
    reader.plan([(k, ((0,) * len(shape), shape), t) for k, shape, t in zip(keys, shapes, targets)]).run()
    return targets
