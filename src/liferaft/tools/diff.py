"""``diff``: compare two checkpoints key by key, streaming (docs/cli/diff.md).

Tensors are compared in slabs of leading-dimension rows (at most ``slab_bytes`` per side in memory), read and
verified like any load, whatever the layouts the two were saved in; plain values are compared decoded. Useful to
check that a resume or a conversion was exact, or how far two steps drifted apart.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from liferaft.options import LoadOptions
from liferaft.reading import check_files, decode_entry_value, open_checkpoint
from liferaft.storage import resolve
from liferaft.storage.refs import with_references
from liferaft.tools._slabs import read_box, slabs


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


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
         tolerance: float = 0.0, slab_bytes: int = 64 << 20, options: LoadOptions | None = None,
         progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``. ``keys``: glob patterns to restrict to. A tensor whose largest absolute
    difference is ≤ ``tolerance`` counts as "equal" (0: bit-exact, NaNs at the same places equal)."""
    opts = options or LoadOptions()
    sa, sb = with_references(resolve(a)), with_references(resolve(b))
    ma, mb = open_checkpoint(sa), open_checkpoint(sb)
    ta, tb = ma.tensor_map(), mb.tensor_map()
    va, vb = {v.key: v for v in ma.values}, {v.key: v for v in mb.values}
    every = list(dict.fromkeys([*ta, *va, *tb, *vb]))
    if keys:
        every = [k for k in every if any(fnmatch.fnmatchcase(k, p) for p in keys)]
    check_files(sa, ma, {c.file for k in every if k in ta for c in ta[k].chunks})
    check_files(sb, mb, {c.file for k in every if k in tb for c in tb[k].chunks})
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
                same = decode_entry_value(va[key], opts.allow_pickle) == decode_entry_value(vb[key], opts.allow_pickle)
                out.append(KeyDiff(key, "equal" if same else "changed"))
            else:
                out.append(KeyDiff(key, "mismatch", detail="a tensor in one, a plain value in the other"))
            continue
        ea, eb = ta[key], tb[key]
        if (ea.shape, ea.dtype, ea.kind) != (eb.shape, eb.dtype, eb.kind):
            out.append(KeyDiff(key, "mismatch", detail=f"{ea.kind} {list(ea.shape)} {ea.dtype} vs "
                                                       f"{eb.kind} {list(eb.shape)} {eb.dtype}"))
            continue
        max_abs = max_rel = 0.0
        equal = True
        for box in slabs(ea, slab_bytes):
            x, y = read_box(sa, ea, box, opts.max_read_bytes), read_box(sb, eb, box, opts.max_read_bytes)
            d_abs, d_rel, eq = _compare(x, y)
            if progress is not None:
                progress(x.numel() * x.element_size())
            max_abs, max_rel, equal = max(max_abs, d_abs), max(max_rel, d_rel), equal and eq
        status = "equal" if equal or (tolerance > 0 and max_abs <= tolerance) else "changed"
        out.append(KeyDiff(key, status, max_abs, max_rel))
    return DiffReport(a=sa.url, b=sb.url, keys=tuple(out))
