"""``diff``: compare two checkpoints key by key, streaming (docs/cli/diff.md).

Tensors are compared in slabs of leading-dimension rows (at most ``slab_bytes`` per side in memory), read and
verified like any load, whatever the layouts the two were saved in; plain values are compared decoded, exactly
(``value_difference``: ``True``, ``1`` and ``1.0`` differ, arrays by dtype, shape and bits), except for the
container shapes formats rebuild (list or tuple, int or string dict keys, DCP's flattened leaves). Either side
may be any format ``tools.formats`` reads; B's keys can be renamed (or put under a prefix) to match A's. Useful
to check that a resume or a conversion was exact, or how far two steps drifted apart.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from liferaft.errors import LiferaftError
from liferaft.options import LoadOptions
from liferaft.state.dtypes import torch_dtype
from liferaft.tools._slabs import slabs
from liferaft.tools._source import Source, _dt


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


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as plain strided CPU memory (sparse made dense, conjugate and negative views resolved)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.cpu().resolve_conj().resolve_neg()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _plain_tensor(t).contiguous().reshape(-1).view(torch.uint8)


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
    d = torch.nan_to_num(d, nan=float("inf"))
    rel = d / a64.abs().clamp_min(1e-30)
    return (float(d.max()) if d.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0, False)


def _regroup(mine: Source, other: Source) -> None:
    """DCP stores each leaf of a nested plain value on its own ("sched.lr", "optim.param_groups.0.lr"), liferaft the
    value whole ("sched"): leaves under a value key the other side holds whole are compared as that one nested
    value (rebuilt by the nesting DCP recorded, else by the dots of the keys; ``same_value`` then compares it by
    value, whatever container shape the rebuilding chose)."""
    if mine.reader is None:
        return
    reader = mine.reader
    for key in [k for k in other.values if k not in mine.values and k not in mine.tensors]:
        under = [k for k in reader.value_parts(key) if k in mine.values]
        if under:
            for k in under:
                mine.values.pop(k)
            mine.values[key] = lambda key=key, under=under: reader.joined_value(key, under)


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
    integer and bool tensors never by tolerance. Plain values are compared exactly, up to the container shapes
    formats rebuild (``value_difference``: lists and tuples alike, int dict keys as strings, a dict keyed 0..n-1
    as the list it was flattened from; ``True``, ``1`` and ``1.0`` differ)."""
    from liferaft.tools._source import open_source
    from liferaft.tools.convert import _renamer

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
                try:
                    why = value_difference(va[key](), vb[key]())
                except ValueTooDeepError as e:
                    raise ValueTooDeepError(f"key {key!r}: {e}") from None
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
        dtype = torch_dtype(da)
        for box in slabs(SimpleNamespace(shape=sha, itemsize=torch.empty(0, dtype=dtype).element_size()),
                         slab_bytes):
            x, y = sa.read(key, box), sb.read(key, box)
            d_abs, d_rel, eq = _compare(x, y)
            if progress is not None:
                progress(x.numel() * x.element_size())
            max_abs, max_rel, equal = max(max_abs, d_abs), max(max_rel, d_rel), equal and eq
        if equal or (tolerance > 0 and not _exact(dtype) and max_abs <= tolerance):
            out.append(KeyDiff(key, "equal", max_abs, max_rel))
        else:
            why = "" if max_abs else "the same numbers, other bits: -0.0 vs 0.0 or NaN payloads"
            out.append(KeyDiff(key, "changed", max_abs, max_rel, why))
    return DiffReport(a=sa.url, b=sb.url, keys=tuple(out))


def same_value(x: Any, y: Any) -> bool:
    """Two plain values equal by value, whatever container shape each format rebuilt them in."""
    return value_difference(x, y) is None


MAX_VALUE_DEPTH = 100
"""How deep ``value_difference`` follows nested plain values (lists, dicts, object arrays, objects' attributes)."""


class ValueTooDeepError(LiferaftError):
    """A plain value nests deeper than ``MAX_VALUE_DEPTH`` (or contains itself): not compared."""


def _index_items(d: dict) -> list[Any] | None:
    """The values of a non-empty dict whose keys are exactly 0..n-1 (ints, or their decimal strings), in index
    order: a list DCP flattened into index keys; None for any other dict."""
    idx: dict[int, Any] = {}
    for k, v in d.items():
        if (isinstance(k, str) and k.isascii() and k.isdigit() and str(int(k)) == k) or (
                isinstance(k, int) and not isinstance(k, bool)):
            i = int(k)
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
    """numpy scalars of the kinds Python has (bool, int, float of at most 64 bits, complex of at most 128, str,
    bytes) as the Python value they hold exactly, numpy arrays torch can hold as tensors (formats store them either
    way); other numpy scalars (longdouble, datetime64, void) as 0-d arrays, compared by dtype and bits."""
    import numpy as np

    if isinstance(v, np.generic):
        k, size = v.dtype.kind, v.dtype.itemsize
        if k in "biuUS" or (k == "f" and size <= 8) or (k == "c" and size <= 16):
            return v.item()
        return np.asarray(v)
    if isinstance(v, np.ndarray):
        if v.dtype.byteorder == ">" or (v.dtype.byteorder == "<" and not _little()):
            v = v.astype(v.dtype.newbyteorder("="))          # the same values in native order: what torch holds
        if v.dtype != object and v.dtype.kind in "biufc":
            try:
                return torch.from_numpy(np.ascontiguousarray(v))
            except TypeError:                                # longdouble, clongdouble: compared as arrays
                return v
    return v


def _little() -> bool:
    import sys

    return sys.byteorder == "little"


_SHORT = None


def _short(v: Any) -> str:
    """At most 60 characters of ``repr(v)``, without building the repr of a huge or deep value."""
    import reprlib

    global _SHORT
    if _SHORT is None:
        _SHORT = reprlib.Repr()
        _SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 4, 60, 60, 60
        _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 8
    if isinstance(v, float):
        r = repr(v)
    else:
        try:
            r = _SHORT.repr(v)
        except Exception:  # noqa: BLE001 - a value whose repr fails still gets a name
            r = f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def _pair(x: Any, y: Any) -> str:
    """``x vs y`` as shown; with the types where the two would show alike (``1 vs 1`` of int and IntEnum)."""
    a, b = _short(x), _short(y)
    if a == b:
        if type(x) is not type(y):
            return f"{a} ({type(x).__name__}) vs {b} ({type(y).__name__})"
        if isinstance(x, float):
            return f"{a} (bits {struct.pack('<d', x).hex()}) vs {b} (bits {struct.pack('<d', y).hex()})"
    return f"{a} vs {b}"


_PYTHON_SCALARS = (bool, int, float, complex, str, bytes, bytearray)


def _kind(v: Any) -> type | None:
    """The kind a plain scalar is compared as: bool is not int, int is not float (``True``, ``1`` and ``1.0``
    differ), bytes and bytearray are one kind."""
    if isinstance(v, bool):
        return bool
    for k in (int, float, complex, str):
        if isinstance(v, k):
            return k
    return bytes if isinstance(v, (bytes, bytearray)) else None


def _same_float(x: float, y: float) -> bool:
    """Bits decide (``-0.0`` is not ``0.0``), except that any NaN equals any NaN: liferaft's value encoding keeps a
    Python float NaN as "NaN", without its sign or payload (tensors and arrays keep and compare them)."""
    if math.isnan(x) and math.isnan(y):
        return True
    return struct.pack("<d", x) == struct.pack("<d", y)


def _strict_key(k: Any) -> Any:
    """A hashable stand-in for ``k`` under which keys equal only when they are the same kind and bits (``1``,
    ``1.0`` and ``True`` are one dict key in Python, three here)."""
    if isinstance(k, float):
        return (float, "nan" if math.isnan(k) else struct.pack("<d", k))
    if isinstance(k, complex):
        return (complex, _strict_key(k.real), _strict_key(k.imag))
    import numpy as np

    if isinstance(k, (np.floating, np.complexfloating)):      # not float/complex subclasses (but float64)
        if k.dtype.itemsize <= (8 if isinstance(k, np.floating) else 16) and k.dtype != np.longdouble:
            return _strict_key(float(k) if isinstance(k, np.floating) else complex(k))   # exact: the same bits
        return (k.dtype.str, k.tobytes())
    if isinstance(k, tuple):
        return (type(k), tuple(_strict_key(i) for i in k))
    if isinstance(k, frozenset):
        return (frozenset, frozenset(_strict_key(i) for i in k))
    return (_kind(k) or type(k), k)


def _dict_key(k: Any) -> Any:
    """Dict keys as compared: an int key and its decimal string are one (JSON and DCP stringify int keys)."""
    if isinstance(k, int) and not isinstance(k, bool):
        return str(int(k))
    return k if type(k) is str else _strict_key(k)


def _where_index(flat: int, shape: Sequence[int]) -> str:
    import numpy as np

    return str([int(i) for i in np.unravel_index(flat, tuple(shape))]) if len(shape) else "[]"


def _tensor_difference(x: torch.Tensor, y: torch.Tensor, at: str) -> str | None:
    """Tensors: equal when dtype, shape and every element's bits are the same (``-0.0`` is not ``0.0``, NaN
    payloads count); else where the first element differs."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{at}: tensor {list(x.shape)} {_dt(x.dtype)} vs {list(y.shape)} {_dt(y.dtype)}"
    try:
        bx, by = _bits(x), _bits(y)
    except (RuntimeError, TypeError) as e:                   # quantized, nested, ...: no plain bits to compare
        return f"{at}: tensors of {x.layout}/{_dt(x.dtype)} cannot be compared bit by bit ({e}); counted as changed"
    if torch.equal(bx, by):
        return None
    n, size = x.numel(), x.element_size()
    differ = (bx.reshape(n, size) != by.reshape(n, size)).any(dim=1).nonzero()
    first = int(differ[0])
    px, py = _plain_tensor(x).reshape(-1)[first], _plain_tensor(y).reshape(-1)[first]
    try:
        vx, vy = px.item(), py.item()
    except (RuntimeError, TypeError, ValueError):
        vx, vy = px, py
    shown = _pair(vx, vy)
    if _short(vx) == _short(vy):
        shown += f" (bits {bx.reshape(n, size)[first].numpy().tobytes().hex()} vs " \
                 f"{by.reshape(n, size)[first].numpy().tobytes().hex()})"
    return f"{at}: tensors differ at {_where_index(first, x.shape)} ({len(differ)} of {n} element(s)): {shown}"


def _array_difference(x: Any, y: Any, where: str, depth: int) -> str | None:
    """numpy arrays torch cannot hold (strings, bytes, datetimes, void/structured, longdouble, objects): equal when
    dtype, shape and every element are the same — bytes for fixed-size dtypes, values (with the sign of zero, any
    NaN equal to any NaN: the padding bytes of longdouble are not part of the value) for longdouble, each element
    by value for object arrays; never by ``repr`` (numpy shortens it with "...")."""
    import numpy as np

    at = where or "the value"
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
        return f"{at}: {_pair(x, y)}"
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{at}: array {list(x.shape)} {x.dtype} vs {list(y.shape)} {y.dtype}"
    fx, fy = x.reshape(-1), y.reshape(-1)
    if x.dtype == object:
        for i, (p, q) in enumerate(zip(fx, fy)):
            d = _difference(p, q, f"{where}{_where_index(i, x.shape)}", depth + 1)
            if d:
                return d
        return None
    if x.dtype.fields:
        for name in x.dtype.names:
            d = _array_difference(x[name], y[name], f"{where}[{name!r}]", depth + 1)
            if d:
                return d
        return None
    if x.dtype.kind in "fc":                                 # longdouble / clongdouble
        parts = [(fx.real, fy.real), (fx.imag, fy.imag)] if x.dtype.kind == "c" else [(fx, fy)]
        same = np.ones(fx.shape, dtype=bool)
        for p, q in parts:
            same &= ((p == q) & (np.signbit(p) == np.signbit(q))) | (np.isnan(p) & np.isnan(q))
    else:
        size = x.dtype.itemsize
        rx = np.ascontiguousarray(fx).view(np.uint8).reshape(len(fx), size)
        ry = np.ascontiguousarray(fy).view(np.uint8).reshape(len(fy), size)
        same = (rx == ry).all(axis=1) if size else np.ones(len(fx), dtype=bool)
    if bool(same.all()):
        return None
    differ = np.flatnonzero(~same)
    first = int(differ[0])
    return (f"{at}: arrays differ at {_where_index(first, x.shape)} ({len(differ)} of {fx.size} element(s)): "
            f"{_pair(*(v.item() if x.dtype.kind in 'USb' else v for v in (fx[first], fy[first])))}")


def value_difference(x: Any, y: Any, where: str = "") -> str | None:
    """None when the plain values ``x`` (of A) and ``y`` (of B) are equal, else where and how they first differ
    (``"[0]['lr']: 0.001 vs 0.002"``). Equality is exact; only what formats change without changing the value is
    normalised: a list equals a tuple (and ``torch.Size``) with equal items; an int dict key equals its decimal
    string (JSON and DCP stringify int keys); a dict keyed exactly 0..n-1 equals the list of its values (DCP stores
    a list of dicts as index keys); a numpy scalar equals the Python scalar of the same kind and exactly the same
    value (``np.int64(3)`` and ``3``, ``np.float32(0.5)`` and ``0.5``, but not ``np.float32(0.1)`` and ``0.1``,
    which are different numbers), while two numpy scalars must also have the same dtype; a numpy array equals the
    tensor of the same dtype, shape and bits; bytes equal bytearrays; a Python float NaN equals any NaN.
    Not normalised: ``True``, ``1`` and ``1.0`` (bool, int, float) all differ, as do ``0.0`` and ``-0.0``; tensors
    and arrays compare by dtype, shape and bits (``-0.0`` vs ``0.0`` and NaN payloads differ; integers exactly,
    at any magnitude); objects of other types must have the same type and compare with their ``==``, or attribute
    by attribute where the type has no ``==`` of its own; anything that cannot be decided counts as a difference.
    Raises ``ValueTooDeepError`` for values nested deeper than ``MAX_VALUE_DEPTH``."""
    return _difference(x, y, where, 0)


def _difference(x: Any, y: Any, where: str, depth: int) -> str | None:
    import numpy as np

    if depth > MAX_VALUE_DEPTH:
        raise ValueTooDeepError(f"{where or 'the value'}: plain values nest deeper than {MAX_VALUE_DEPTH} levels "
                                f"(or contain themselves); diff does not compare them — compare that key by hand")
    at = where or "the value"
    if isinstance(x, np.generic) and isinstance(y, np.generic) and x.dtype != y.dtype:
        return f"{at}: {_short(x)} ({x.dtype}) vs {_short(y)} ({y.dtype})"
    x, y = _plainer(x), _plainer(y)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return f"{at}: {_pair(x, y)}"
        return _tensor_difference(x, y, at)
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return _array_difference(x, y, where, depth)
    sx, sy = _sequence(x), _sequence(y)
    if sx is not None and sy is not None and (not isinstance(x, dict) or not isinstance(y, dict)):
        if len(sx) != len(sy):
            return f"{at}: {len(sx)} item(s) vs {len(sy)}"
        for i, (p, q) in enumerate(zip(sx, sy)):
            d = _difference(p, q, f"{where}[{i}]", depth + 1)
            if d:
                return d
        return None
    if isinstance(x, dict) and isinstance(y, dict):
        kx, ky = {_dict_key(k): k for k in x}, {_dict_key(k): k for k in y}
        if len(kx) != len(x) or len(ky) != len(y):      # both 1 and "1" in one dict: compare keys as they are
            kx, ky = {_strict_key(k): k for k in x}, {_strict_key(k): k for k in y}
        if set(kx) != set(ky):
            only_a = sorted(str(kx[k]) for k in set(kx) - set(ky))
            only_b = sorted(str(ky[k]) for k in set(ky) - set(kx))
            return f"{at}: keys only in A {only_a[:5]}, only in B {only_b[:5]}"
        for n, k in kx.items():
            d = _difference(x[k], y[ky[n]], f"{where}[{k!r}]", depth + 1)
            if d:
                return d
        return None
    if isinstance(x, _PYTHON_SCALARS) or isinstance(y, _PYTHON_SCALARS):
        kind = _kind(x)
        if kind is None or kind is not _kind(y):
            return f"{at}: {_pair(x, y)}"
        if (type(x) not in _PYTHON_SCALARS or type(y) not in _PYTHON_SCALARS) and type(x) is not type(y):
            return f"{at}: {_pair(x, y)}"                   # an IntEnum member is not the int it stands for
        if kind is float:
            eq = _same_float(x, y)
        elif kind is complex:
            eq = _same_float(x.real, y.real) and _same_float(x.imag, y.imag)
        elif kind is bytes:
            eq = bytes(x) == bytes(y)
        else:
            eq = x == y
        if eq:
            return None
        if kind is str and _short(x) == _short(y):
            i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"{at}: strings differ at character {i} (lengths {len(x)} and {len(y)})"
        return f"{at}: {_pair(x, y)}"
    if type(x) is not type(y):
        return f"{at}: {_pair(x, y)}"
    if isinstance(x, (set, frozenset)):
        if {_strict_key(i) for i in x} == {_strict_key(i) for i in y}:
            return None
        return f"{at}: {_pair(x, y)}"
    if type(x).__eq__ is object.__eq__ and hasattr(x, "__dict__"):     # no == of its own: compare attributes
        return _difference(vars(x), vars(y), f"{where}.__dict__" if where else "__dict__", depth + 1)
    try:
        eq = x == y
    except Exception as e:  # noqa: BLE001 - an == that fails decides nothing: counted as a difference
        return f"{at}: {type(x).__name__} values cannot be compared ({type(e).__name__}); counted as changed"
    if isinstance(eq, (bool, np.bool_)):
        return None if eq else f"{at}: {_pair(x, y)}"
    return f"{at}: {type(x).__name__} values cannot be compared (== gave a {type(eq).__name__}); counted as changed"
