"""``diff``: compare two checkpoints key by key, streaming (docs/cli/diff.md).

Tensors are compared in slabs of leading-dimension rows (at most ``slab_bytes`` per side in memory), read and
verified like any load, whatever the layouts the two were saved in; plain values are compared decoded, by value
(``value_difference``: the container shapes formats rebuild — list or tuple, int or string dict keys, DCP's
flattened leaves — do not count). Either side may be any format ``tools.formats`` reads; B's keys can be renamed
(or put under a prefix) to match A's. Useful to check that a resume or a conversion was exact, or how far two
steps drifted apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from liferaft.options import LoadOptions
from liferaft.tools._slabs import slabs
from liferaft.tools.formats import Source, _dt
from liferaft.transfer.tensors import torch_dtype


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
    a: str
    b: str
    keys: tuple[KeyDiff, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        return all(k.status == "equal" for k in self.keys)

    def changed(self) -> list[KeyDiff]:
        return [k for k in self.keys if k.status != "equal"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max |a − b|, max |a − b| / |a|, bit-identical); NaNs in the same places count as no difference."""
    equal = torch.equal(_bits(a), _bits(b))
    if equal:
        return 0.0, 0.0, True
    wide = torch.complex128 if a.is_complex() else torch.float64
    a64, b64 = a.to(wide), b.to(wide)
    d = (a64 - b64).abs()
    if not a.is_complex():
        d = torch.where(torch.isnan(a64) & torch.isnan(b64), torch.zeros_like(d), d)
    d = torch.nan_to_num(d, nan=float("inf"))
    rel = d / a64.abs().clamp_min(1e-30)
    return (float(d.max()) if d.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0, False)


def _regroup(mine: Source, other: Source) -> None:
    """DCP stores each leaf of a nested plain value on its own ("sched.lr", "optim.param_groups.0.lr"), liferaft the
    value whole ("sched"): leaves under a value key the other side holds whole are compared as that one nested
    value (rebuilt by the nesting DCP recorded, else by the dots of the keys; ``same_value`` then compares it by
    value, whatever container shape the rebuilding chose)."""
    from liferaft.tools.dcp_format import joined_value, value_parts

    for key in [k for k in other.values if k not in mine.values and k not in mine.tensors]:
        under = value_parts(mine.values, key)
        if under:
            got = {k: mine.values.pop(k) for k in under}
            mine.values[key] = lambda key=key, got=got: joined_value(key, list(got), lambda k: got[k](), mine.paths)


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
         tolerance: float = 0.0, rename: Sequence[tuple[str, str]] | None = None, module: str | None = None,
         slab_bytes: int = 64 << 20, options: LoadOptions | None = None,
         progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``: liferaft checkpoints, or either side a Hugging Face safetensors
    folder/file, a DCP folder or a ``torch.save`` file (to check a conversion without converting back).

    Keys are matched in A's names: B's keys are first renamed by ``rename`` (``(regex, replacement)`` pairs applied
    in order, ``re.sub`` syntax), then, with ``module="KEY"``, prefixed by ``KEY.`` while A is restricted to its
    keys under ``KEY`` — so an export of one module (``convert --to hf``, keys without the prefix) is compared with
    its subtree of the source. ``keys``: glob patterns (in A's names) to restrict to. A tensor whose largest
    absolute difference is ≤ ``tolerance`` counts as "equal" (0: bit-exact, NaNs at the same places equal). Plain
    values are compared by value (``same_value``: lists and tuples alike, dict keys as strings, a dict keyed
    0..n-1 as the list it was flattened from)."""
    from liferaft.tools.convert import _renamer
    from liferaft.tools.formats import open_source

    opts = options or LoadOptions()
    sa = open_source(a, keys, opts)
    if rename or module:
        sb = open_source(b, None, opts)
        rn = _renamer(rename)
        sb = sb.renamed((lambda k: f"{module}.{rn(k)}") if module else rn).selected(keys)
    else:
        sb = open_source(b, keys, opts)
    if module:
        sa = sa.selected([module, f"{module}.*"])
    _regroup(sa, sb)
    _regroup(sb, sa)
    ta, tb, va, vb = sa.tensors, sb.tensors, sa.values, sb.values
    every = list(dict.fromkeys([*ta, *va, *tb, *vb]))
    out: list[KeyDiff] = []
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
                why = value_difference(va[key](), vb[key]())
                out.append(KeyDiff(key, "changed", detail=why) if why else KeyDiff(key, "equal"))
            else:
                out.append(KeyDiff(key, "mismatch", detail="a tensor in one, a plain value in the other"))
            continue
        (da, sha, ka), (db, shb, kb) = ta[key], tb[key]
        kinds_differ = ka != kb and sa.fmt == sb.fmt == "liferaft"     # other formats hold numpy arrays as tensors
        if (sha, da) != (shb, db) or kinds_differ:
            out.append(KeyDiff(key, "mismatch", detail=f"{ka} {list(sha)} {da} vs {kb} {list(shb)} {db}"))
            continue
        max_abs = max_rel = 0.0
        equal = True
        for box in slabs(SimpleNamespace(shape=sha, itemsize=torch.empty(0, dtype=torch_dtype(da)).element_size()),
                         slab_bytes):
            x, y = sa.read(key, box), sb.read(key, box)
            d_abs, d_rel, eq = _compare(x, y)
            if progress is not None:
                progress(x.numel() * x.element_size())
            max_abs, max_rel, equal = max(max_abs, d_abs), max(max_rel, d_rel), equal and eq
        status = "equal" if equal or (tolerance > 0 and max_abs <= tolerance) else "changed"
        out.append(KeyDiff(key, status, max_abs, max_rel))
    return DiffReport(a=sa.url, b=sb.url, keys=tuple(out))


def same_value(x: Any, y: Any) -> bool:
    """Two plain values equal by value, whatever container shape each format rebuilt them in."""
    return value_difference(x, y) is None


def _index_items(d: dict) -> list[Any] | None:
    """The values of a non-empty dict whose keys are exactly 0..n-1 (ints, or their decimal strings), in index
    order: a list DCP flattened into index keys; None for any other dict."""
    idx: dict[int, Any] = {}
    for k, v in d.items():
        if isinstance(k, str) and k.isdigit() and str(int(k)) == k:
            i = int(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            i = k
        else:
            return None
        if i in idx:
            return None
        idx[i] = v
    return [idx[i] for i in range(len(idx))] if d and set(idx) == set(range(len(idx))) else None


def _sequence(v: Any) -> list[Any] | None:
    if isinstance(v, (list, tuple)):
        return list(v)
    return _index_items(v) if isinstance(v, dict) else None


def _plainer(v: Any) -> Any:
    """numpy scalars as Python numbers, numpy arrays as tensors (formats store them either way)."""
    import numpy as np

    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.dtype != object:
        try:
            return torch.from_numpy(np.ascontiguousarray(v))
        except TypeError:
            return v
    return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def value_difference(x: Any, y: Any, where: str = "") -> str | None:
    """None when the plain values ``x`` (of A) and ``y`` (of B) are equal by value, else where and how they first
    differ (``"[0]['lr']: 0.001 vs 0.002"``). The comparison normalises what formats change without changing the
    value: a list equals a tuple (and ``torch.Size``) with equal items; dict keys compare as strings (JSON and DCP
    stringify int keys); a dict keyed exactly 0..n-1 equals the list of its values (DCP stores a list of dicts as
    index keys); numpy scalars equal the Python numbers, numpy arrays the tensors of the same dtype and values;
    bytes equal bytearrays; NaN equals NaN. Tensors compare by dtype, shape and bits."""
    import math

    x, y = _plainer(x), _plainer(y)
    at = where or "the value"
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return f"{at}: {_short(x)} vs {_short(y)}"
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{at}: tensor {list(x.shape)} {_dt(x.dtype)} vs {list(y.shape)} {_dt(y.dtype)}"
        d_abs, _, bits = _compare(x, y)
        return None if bits or d_abs == 0 else f"{at}: tensors differ (max abs {d_abs:.3g})"
    sx, sy = _sequence(x), _sequence(y)
    if sx is not None and sy is not None and (not isinstance(x, dict) or not isinstance(y, dict)):
        if len(sx) != len(sy):
            return f"{at}: {len(sx)} item(s) vs {len(sy)}"
        for i, (p, q) in enumerate(zip(sx, sy)):
            d = value_difference(p, q, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(x, dict) and isinstance(y, dict):
        kx, ky = {str(k): v for k, v in x.items()}, {str(k): v for k, v in y.items()}
        if len(kx) != len(x) or len(ky) != len(y):          # keys that differ only by type: compare as they are
            kx, ky = dict(x), dict(y)
        if set(kx) != set(ky):
            only_a, only_b = sorted(map(str, set(kx) - set(ky))), sorted(map(str, set(ky) - set(kx)))
            return f"{at}: keys only in A {only_a[:5]}, only in B {only_b[:5]}"
        for k in kx:
            d = value_difference(kx[k], ky[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return None
    if isinstance(x, (bytes, bytearray)) and isinstance(y, (bytes, bytearray)):
        return None if bytes(x) == bytes(y) else f"{at}: {_short(bytes(x))} vs {_short(bytes(y))}"
    try:
        eq = bool(x == y)
    except Exception:  # noqa: BLE001 - objects whose == does not give a truth value: compare what they show
        eq = repr(x) == repr(y)
    return None if eq else f"{at}: {_short(x)} vs {_short(y)}"

