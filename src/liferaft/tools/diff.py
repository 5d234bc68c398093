"""``diff``: compare two checkpoints key by key, streaming (docs/cli/diff.md).

Tensors are compared in slabs of leading-dimension rows (at most ``slab_bytes`` per side in memory), read and
verified like any load, whatever the layouts the two were saved in; plain values are compared decoded. Useful to
check that a resume or a conversion was exact, or how far two steps drifted apart.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from liferaft.options import LoadOptions
from liferaft.reading import check_files, decode_entry_value, open_checkpoint
from liferaft.storage import resolve
from liferaft.storage.refs import with_references
from liferaft.tools._slabs import read_box, slabs
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


@dataclass
class _Side:
    """One side of a diff, whatever its format: tensors by key as (dtype name, shape, kind), a reader of a box of
    one of them, and the plain values (decoded on demand)."""

    url: str
    fmt: str
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    read: Callable[[str, Any], torch.Tensor]
    values: dict[str, Callable[[], Any]]
    chunks: dict[str, Any] = field(default_factory=dict)        # DCP: each tensor's saved chunks
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)   # DCP: the nesting it recorded per key


def _dt(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def _box(t: torch.Tensor, box: Any) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(*box)):
        t = t.narrow(d, o, n)
    return t


def side_of(path: str | os.PathLike[str], keys: Sequence[str] | None, opts: LoadOptions) -> _Side:
    """The tensors and values of a checkpoint in any format ``detect_format`` knows, read on demand."""
    from liferaft.tools.convert import detect_format

    fmt = detect_format(path)
    picked = (lambda k: not keys or any(fnmatch.fnmatchcase(k, p) for p in keys))
    if fmt == "liferaft":
        st = with_references(resolve(path))
        m = open_checkpoint(st)
        ts = {e.key: e for e in m.tensors if picked(e.key)}
        check_files(st, m, {c.file for e in ts.values() for c in e.chunks})
        return _Side(st.url, fmt, {k: (e.dtype, tuple(e.shape), e.kind) for k, e in ts.items()},
                     lambda k, box: read_box(st, ts[k], box, opts.max_read_bytes),
                     {v.key: (lambda v=v: decode_entry_value(v, opts.allow_pickle)) for v in m.values if picked(v.key)})
    if fmt == "dcp":
        from liferaft.tools.dcp_format import DcpCheckpoint

        ck = DcpCheckpoint(path)

        def read_dcp(k: str, box: Any) -> torch.Tensor:
            out = torch.empty(box[1], dtype=ck.tensors[k].dtype)
            ck.copy_box(k, box[0], out)
            return out
        return _Side(os.fspath(path), fmt, {k: (_dt(t.dtype), t.shape, "tensor") for k, t in ck.tensors.items()
                                            if picked(k)}, read_dcp,
                     {k: (lambda k=k: ck.value(k)) for k in ck.values if picked(k)},
                     {k: t.chunks for k, t in ck.tensors.items()}, ck.paths)
    if fmt == "safetensors":
        from liferaft.tools.convert import safetensors_state

        mapped = safetensors_state(path, keys)
        return _Side(os.fspath(path), fmt, {k: (_dt(t.dtype), tuple(t.shape), "tensor") for k, t in mapped.items()},
                     lambda k, box: _box(mapped[k], box), {})
    from liferaft.state.flatten import flatten

    flat = flatten(torch.load(os.fspath(path), weights_only=True, mmap=True, map_location="cpu"))
    full = {leaf.key: leaf.parts[0][1] for leaf in flat.tensors if picked(leaf.key)}
    return _Side(os.fspath(path), fmt, {k: (_dt(t.dtype), tuple(t.shape), "tensor") for k, t in full.items()},
                 lambda k, box: _box(full[k], box), {k: (lambda v=v: v) for k, _, v in flat.values if picked(k)})


def _regroup(mine: _Side, other: _Side) -> None:
    """DCP stores each leaf of a nested plain value on its own ("sched.lr"), liferaft the value whole ("sched"):
    leaves under a value key the other side holds whole are compared as that one nested value."""
    from liferaft.tools.dcp_format import joined_value, value_parts

    for key in [k for k in other.values if k not in mine.values]:
        under = value_parts(mine.values, key)
        if under:
            got = {k: mine.values.pop(k) for k in under}
            mine.values[key] = lambda key=key, got=got: joined_value(key, list(got), lambda k: got[k]())


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
         tolerance: float = 0.0, slab_bytes: int = 64 << 20, options: LoadOptions | None = None,
         progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``: liferaft checkpoints, or either side a Hugging Face safetensors
    folder/file, a DCP folder or a ``torch.save`` file (to check a conversion without converting back).
    ``keys``: glob patterns to restrict to. A tensor whose largest absolute difference is ≤ ``tolerance`` counts
    as "equal" (0: bit-exact, NaNs at the same places equal)."""
    opts = options or LoadOptions()
    sa, sb = side_of(a, keys, opts), side_of(b, keys, opts)
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
                out.append(KeyDiff(key, "equal" if _same(va[key](), vb[key]()) else "changed"))
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


def _same(x: Any, y: Any) -> bool:
    """Plain values equal, also across formats (a tuple in one may be a list in the other; tensors by value)."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return set(map(str, x)) == set(map(str, y)) and all(_same(x[k], _lookup(y, k)) for k in x)
    return bool(x == y)


def _lookup(d: dict, k: Any) -> Any:
    return d[k] if k in d else d[str(k)] if str(k) in d else d[int(k)]
