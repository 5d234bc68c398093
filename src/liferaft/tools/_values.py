"""Exact comparison of plain values as formats rebuild them (``value_difference``), for ``diff``: numpy scalars and
arrays by kind and bits; and, where a side's format does not record container types (``lenient``), lists and tuples
alike, int dict keys as strings, DCP's index-keyed dicts as lists."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from liferaft.errors import LiferaftError
from liferaft.state.values import MAX_NESTING


def _dt(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as plain strided CPU memory (sparse made dense, conjugate and negative views resolved)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.cpu().resolve_conj().resolve_neg()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _plain_tensor(t).contiguous().reshape(-1).view(torch.uint8)


def same_value(x: Any, y: Any, lenient: bool = True) -> bool:
    """Two plain values equal by value (``value_difference``; ``lenient``: whatever container shape each format
    rebuilt them in)."""
    return value_difference(x, y, lenient=lenient) is None


MAX_VALUE_DEPTH = MAX_NESTING
"""(``format.limits.MAX_NESTING``, the one nesting limit) How deep ``value_difference`` follows nested plain values (lists, dicts, object arrays, objects' attributes)."""


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


def _array_difference(x: Any, y: Any, where: str, depth: int, lenient: bool) -> str | None:
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
            d = _difference(p, q, f"{where}{_where_index(i, x.shape)}", depth + 1, lenient)
            if d:
                return d
        return None
    if x.dtype.fields:
        for name in x.dtype.names:
            d = _array_difference(x[name], y[name], f"{where}[{name!r}]", depth + 1, lenient)
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


def value_difference(x: Any, y: Any, where: str = "", *, lenient: bool = True) -> str | None:
    """None when the plain values ``x`` (of A) and ``y`` (of B) are equal, else where and how they first differ
    (``"[0]['lr']: 0.001 vs 0.002"``). Equality is exact; only what formats change without changing the value is
    normalised. With ``lenient`` (for a side whose format does not record container types: DCP, ``torch.save``,
    safetensors rebuild them their own way) a list equals a tuple (and ``torch.Size``) with equal items, an int
    dict key equals its decimal string (JSON and DCP stringify int keys) and a dict keyed exactly 0..n-1 equals the
    list of its values (DCP stores a list of dicts as index keys); without it (two liferaft checkpoints, which store
    and load back each of these as what it was) containers must be of the same type and dict keys of the same kind
    (``{1: "x"}`` vs ``{"1": "x"}``, ``[1, 2]`` vs ``(1, 2)``, ``{0: "a", 1: "b"}`` vs ``["a", "b"]`` differ).
    Always: a numpy scalar equals the Python scalar of the same kind and exactly the same
    value (``np.int64(3)`` and ``3``, ``np.float32(0.5)`` and ``0.5``, but not ``np.float32(0.1)`` and ``0.1``,
    which are different numbers), while two numpy scalars must also have the same dtype; a numpy array equals the
    tensor of the same dtype, shape and bits; bytes equal bytearrays; a Python float NaN equals any NaN.
    Not normalised: ``True``, ``1`` and ``1.0`` (bool, int, float) all differ, as do ``0.0`` and ``-0.0``; tensors
    and arrays compare by dtype, shape and bits (``-0.0`` vs ``0.0`` and NaN payloads differ; integers exactly,
    at any magnitude); objects of other types must have the same type and compare with their ``==``, or attribute
    by attribute where the type has no ``==`` of its own; anything that cannot be decided counts as a difference.
    Raises ``ValueTooDeepError`` for values nested deeper than ``MAX_VALUE_DEPTH``."""
    return _difference(x, y, where, 0, lenient)


def _difference(x: Any, y: Any, where: str, depth: int, lenient: bool) -> str | None:
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
        return _array_difference(x, y, where, depth, lenient)
    if not lenient and isinstance(x, (list, tuple, dict)) and type(x) is not type(y) and \
            not (isinstance(x, dict) and isinstance(y, dict)):     # (an OrderedDict equals a dict, as in Python)
        return f"{at}: {type(x).__name__} vs {type(y).__name__} ({_pair(x, y)})"
    sx, sy = (_sequence(x), _sequence(y)) if lenient else (
        (list(x), list(y)) if isinstance(x, (list, tuple)) else (None, None))
    if sx is not None and sy is not None and (not isinstance(x, dict) or not isinstance(y, dict)):
        if len(sx) != len(sy):
            return f"{at}: {len(sx)} item(s) vs {len(sy)}"
        for i, (p, q) in enumerate(zip(sx, sy)):
            d = _difference(p, q, f"{where}[{i}]", depth + 1, lenient)
            if d:
                return d
        return None
    if isinstance(x, dict) and isinstance(y, dict):
        kx, ky = {_dict_key(k): k for k in x}, {_dict_key(k): k for k in y}
        if not lenient or len(kx) != len(x) or len(ky) != len(y):  # exact, or 1 and "1" in one dict: keys as they are
            kx, ky = {_strict_key(k): k for k in x}, {_strict_key(k): k for k in y}
        if set(kx) != set(ky):
            only_a = sorted((kx[k] for k in set(kx) - set(ky)), key=str)      # shown as keys: 1 is not '1'
            only_b = sorted((ky[k] for k in set(ky) - set(kx)), key=str)
            return f"{at}: keys only in A {only_a[:5]}, only in B {only_b[:5]}"
        for n, k in kx.items():
            d = _difference(x[k], y[ky[n]], f"{where}[{k!r}]", depth + 1, lenient)
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
        return _difference(vars(x), vars(y), f"{where}.__dict__" if where else "__dict__", depth + 1, lenient)
    try:
        eq = x == y
    except Exception as e:  # noqa: BLE001 - an == that fails decides nothing: counted as a difference
        return f"{at}: {type(x).__name__} values cannot be compared ({type(e).__name__}); counted as changed"
    if isinstance(eq, (bool, np.bool_)):
        return None if eq else f"{at}: {_pair(x, y)}"
    return f"{at}: {type(x).__name__} values cannot be compared (== gave a {type(eq).__name__}); counted as changed"
