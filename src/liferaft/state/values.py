"""Plain values ↔ tagged JSON, without pickle unless explicitly allowed.

Supported: None, bool, int, float (incl. nan/inf), complex, str, bytes, list, tuple, dict (any keys of these
types), set/frozenset, small numpy arrays (``numpy.ndarray`` itself) and numpy scalars of dtypes whose ``str``
says all (no fields, objects or raw void: a structured, record or masked array needs pickle), torch.dtype and
torch.Size. Anything else is
refused with PickleNotAllowedError unless ``allow_pickle`` is set; decoding a pickled value also needs
``allow_pickle``. Tags are objects with a single ``"$..."`` key, so plain JSON stays plain.
"""

from __future__ import annotations

import base64
import json
import math
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from liferaft.errors import CorruptCheckpointError, InvalidStateError, PickleNotAllowedError
from liferaft.format.limits import MAX_INT, MAX_NDIM, MAX_NESTING

__all__ = ["MAX_NESTING", "PerRank", "as_leaf", "decode_value", "digest_encoded", "encode_value", "per_rank_leaf"]


class PerRank(tuple):
    """A plain value or tensor that differed between the saving ranks: one item per saving rank (None for a rank
    that did not hold it). ``held``: the ranks that held it when the checkpoint says some did not (None: every rank
    did, or the checkpoint does not say), so a None a rank held is told from a rank that held nothing."""

    held: tuple[int, ...] | None = None


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


_SELF_ENCODED = frozenset({int, str, bool, type(None)})   # exact types that encode_value returns unchanged


def encode_value(v: Any, key: str, allow_pickle: bool = False, _depth: int = 0) -> Any:
    """Encode ``v`` (stored under ``key``) to JSON-compatible data. A value nesting containers deeper than
    ``MAX_NESTING`` levels (or containing itself) is refused with InvalidStateError naming ``key``."""
    if _depth > MAX_NESTING:
        raise InvalidStateError(f"key {key!r}: the plain value nests containers deeper than {MAX_NESTING} levels "
                                "(or contains itself); store it flatter, e.g. as a string or a tensor")
    d = _depth + 1
    if v is None or isinstance(v, (bool, str)):
        return v
    if type(v) is int:
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"$float": repr(v)}
    if type(v) is complex:         # (numpy's complex scalars subclass complex: they are $npscalar, below)
        return {"$complex": [encode_value(v.real, key, _depth=d), encode_value(v.imag, key, _depth=d)]}
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(v))}
    if isinstance(v, np.ndarray):
        if type(v) is not np.ndarray or not _plain_dtype(v.dtype):
            return _pickled(v, key, allow_pickle)   # (a masked array's mask, a record's fields: not in the bytes)
        return {"$ndarray": {"dtype": v.dtype.str, "shape": list(v.shape),
                             "data": _b64(np.ascontiguousarray(v).tobytes())}}
    if isinstance(v, np.generic):
        if not _plain_dtype(v.dtype):
            return _pickled(v, key, allow_pickle)
        return {"$npscalar": {"dtype": v.dtype.str, "data": _b64(v.tobytes())}}
    if type(v) is list:
        if d <= MAX_NESTING and _SELF_ENCODED.issuperset(map(type, v)):   # (each is its own encoding)
            return list(v)
        return [encode_value(x, key, allow_pickle, d) for x in v]
    if type(v) is tuple:
        if d <= MAX_NESTING and _SELF_ENCODED.issuperset(map(type, v)):
            return {"$tuple": list(v)}
        return {"$tuple": [encode_value(x, key, allow_pickle, d) for x in v]}
    if type(v) in (set, frozenset):
        return {"$set" if type(v) is set else "$frozenset": [encode_value(x, key, allow_pickle, d) for x in v]}
    if type(v) is dict:
        if all(type(k) is str and not k.startswith("$") for k in v):
            return {k: encode_value(x, key, allow_pickle, d) for k, x in v.items()}
        return {"$dict": [[encode_value(k, key, allow_pickle, d), encode_value(x, key, allow_pickle, d)]
                          for k, x in v.items()]}
    tv = _torch_value(v)
    if tv is not None:
        return tv
    return _pickled(v, key, allow_pickle)


def _plain_dtype(dt: np.dtype) -> bool:
    """Whether ``dt.str`` says all there is to values of ``dt``: no objects, no fields (a structured or record
    dtype's ``str`` is ``|V<n>``, its names lost), no sub-array, no raw void."""
    return not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.kind != "V"


def _torch_value(v: Any) -> Any:
    import torch

    if isinstance(v, torch.dtype):
        return {"$torch_dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Size):
        return {"$torch_size": list(v)}
    return None


def _pickled(v: Any, key: str, allow_pickle: bool) -> Any:
    if not allow_pickle:
        what = f"{type(v).__module__}.{type(v).__qualname__}"
        if isinstance(v, (np.ndarray, np.generic)):
            what += f" of dtype {v.dtype!r}"
        raise PickleNotAllowedError(
            f"key {key!r}: a value of type {what} can only be stored with "
            "pickle; convert it to plain data (numbers, strings, lists, dicts, numpy arrays, tensors) or pass "
            "SaveOptions(allow_pickle=True) (loading it then needs allow_pickle=True too)")
    try:
        return {"$pickle": _b64(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))}
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        raise PickleNotAllowedError(f"key {key!r}: value of type {type(v).__qualname__} cannot be pickled: {e}") from None


def digest_encoded(encoded: Any) -> str:
    from liferaft.codecs.checksum import digest

    return digest(json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode())


def decode_value(d: Any, key: str, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode_value`; raises CorruptCheckpointError on malformed data."""
    if d is None or isinstance(d, (bool, int, float, str)):
        return d
    if isinstance(d, list):
        return [decode_value(x, key, allow_pickle) for x in d]
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"key {key!r}: malformed stored value of type {type(d).__name__}: {repr(d)[:80]}")
    if len(d) == 1:
        (tag, body), = d.items()
        if tag.startswith("$"):
            return _decode_tag(tag, body, key, allow_pickle)
    return {k: decode_value(x, key, allow_pickle) for k, x in d.items()}


class _Bad(Exception):
    """A tagged value's body is not what its tag's encoder writes (the reason)."""


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise _Bad(why)


def _b64_body(body: Any) -> bytes:
    _need(isinstance(body, str), "its data is not a string")
    try:
        return base64.b64decode(body, validate=True)
    except ValueError:
        raise _Bad("its data is not valid base64") from None


def _items(body: Any) -> list[Any]:
    _need(isinstance(body, list), f"its body is a {type(body).__name__}, not a list")
    return body


def _dims(shape: Any) -> list[int]:
    _need(isinstance(shape, list) and len(shape) <= MAX_NDIM, f"shape is not a list of at most {MAX_NDIM} sizes")
    _need(all(type(n) is int and 0 <= n <= MAX_INT for n in shape), "a size is not an integer in [0, 2**63)")
    return shape


def _array_dtype(body: Any, fields: set[str]) -> np.dtype:
    _need(isinstance(body, dict) and set(body) == fields, f"its body is not an object of {sorted(fields)}")
    _need(isinstance(body["dtype"], str) and len(body["dtype"]) <= 64, "its dtype is not a short string")
    try:
        dt = np.dtype(body["dtype"])
    except (TypeError, ValueError, SyntaxError):
        raise _Bad(f"unknown numpy dtype {body['dtype']!r}") from None
    _need(_plain_dtype(dt) and dt.itemsize > 0 and dt.str == body["dtype"],
          f"numpy dtype {body['dtype']!r} is not one encode_value writes (objects, fields, a sub-array, raw void, "
          "no bytes, or not in its canonical form)")
    return dt


def _bool_bytes(data: bytes, dt: np.dtype) -> None:
    """A bool array's bytes are 0 or 1 (numpy reads any other byte as a bool that is neither)."""
    _need(dt.kind != "b" or not data.strip(b"\0\1"), "a bool holds a byte other than 0 or 1")


def _decode_tag(tag: str, body: Any, key: str, allow_pickle: bool) -> Any:
    """A tagged value decoded, its body checked to be exactly what ``encode_value`` writes for the tag (types,
    ranges, base64, sizes); CorruptCheckpointError naming the key and the tag otherwise."""
    try:
        return _decode_checked(tag, body, key, allow_pickle)
    except (CorruptCheckpointError, PickleNotAllowedError):
        raise
    except _Bad as e:
        raise CorruptCheckpointError(f"key {key!r}: malformed stored value with tag {tag}: {e}; the checkpoint is "
                                     "damaged") from None
    except Exception as e:  # noqa: BLE001 - malformed data of any shape
        raise CorruptCheckpointError(f"key {key!r}: malformed stored value with tag {tag}: "
                                     f"{type(e).__name__}: {str(e)[:200]}; the checkpoint is damaged") from None


def _decode_checked(tag: str, body: Any, key: str, allow_pickle: bool) -> Any:
    if tag == "$float":
        _need(body in ("nan", "inf", "-inf"), "not 'nan', 'inf' or '-inf'")
        return float(body)
    if tag == "$complex":
        parts = [decode_value(x, key) for x in _items(body)]
        _need(len(parts) == 2 and all(type(x) in (int, float) for x in parts), "not two real numbers")
        return complex(parts[0], parts[1])
    if tag == "$bytes":
        return _b64_body(body)
    if tag == "$ndarray":
        dt = _array_dtype(body, {"dtype", "shape", "data"})
        shape = _dims(body["shape"])
        data = _b64_body(body["data"])
        n = 1
        for d in shape:
            n *= d
        _need(n * dt.itemsize == len(data), f"{len(data)} data bytes for shape {shape} of {dt.str}")
        _bool_bytes(data, dt)
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()
    if tag == "$npscalar":
        dt = _array_dtype(body, {"dtype", "data"})
        data = _b64_body(body["data"])
        _need(len(data) == dt.itemsize, f"{len(data)} data bytes for one {dt.str}")
        _bool_bytes(data, dt)
        return np.frombuffer(data, dtype=dt)[0]
    if tag == "$tuple":
        return tuple(decode_value(x, key, allow_pickle) for x in _items(body))
    if tag in ("$set", "$frozenset"):
        items = [decode_value(x, key, allow_pickle) for x in _items(body)]
        out = set(items) if tag == "$set" else frozenset(items)
        # (a saved set never holds an item twice: two readers could keep different ones, as with a JSON object)
        _need(len(out) == len(items), f"a {tag[1:]} holds an item twice")
        return out
    if tag == "$dict":
        pairs = _items(body)
        _need(all(isinstance(p, list) and len(p) == 2 for p in pairs), "an item is not a [key, value] pair")
        got = {decode_value(k, key, allow_pickle): decode_value(x, key, allow_pickle) for k, x in pairs}
        _need(len(got) == len(pairs), "a dict holds a key twice")
        return got
    if tag == "$torch_dtype":
        import torch

        dt = getattr(torch, body, None) if isinstance(body, str) and body.isidentifier() else None
        if not isinstance(dt, torch.dtype):
            raise CorruptCheckpointError(f"key {key!r}: unknown torch dtype {str(body)[:80]!r}")
        return dt
    if tag == "$torch_size":
        import torch

        return torch.Size(_dims(body))
    if tag == "$pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"key {key!r} holds a pickled value; loading it would run code from the checkpoint. "
                "Pass allow_pickle=True only if you trust the checkpoint")
        return pickle.loads(_b64_body(body))
    raise CorruptCheckpointError(f"key {key!r}: unknown value tag {tag[:80]!r}; written by a newer liferaft?")


def as_leaf(kind: str, t: Any) -> Any:
    """A loaded tensor as what was saved: the tensor itself, or for ``kind`` "numpy"/"bytes" a numpy array/bytes."""
    if kind == "numpy":
        return t.numpy()
    if kind == "bytes":
        return t.numpy().tobytes()
    return t


def per_rank_leaf(kind: str, ranks: Sequence[int], t: Any, world: int) -> PerRank:
    """A tensor stored per rank (rows ``ranks`` of ``t``), read whole, as a ``PerRank`` of ``world`` items (None
    for a rank that did not hold it)."""
    rows = dict(zip(ranks, t.unbind(0)))
    return PerRank(as_leaf(kind, rows[r].clone()) if r in rows else None for r in range(world))
