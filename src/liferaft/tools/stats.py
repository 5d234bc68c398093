"""Per-tensor summary statistics of a checkpoint, computed streaming (row slabs), and the storage view of each
key (chunks, files, stored bytes, codecs, lossy): ``liferaft inspect --stats`` (docs/cli/inspect.md)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from liferaft.core.commit import check_files, open_checkpoint
from liferaft.formats.base import matches
from liferaft.state.dtypes import torch_dtype
from liferaft.storage import resolve
from liferaft.storage.refs import with_references
from liferaft.tools._slabs import read_box, slabs


@dataclass(frozen=True)
class KeyInfo:
    """How one tensor of a checkpoint is stored (``describe``): dtype, shape and bytes; bytes stored in this
    checkpoint (not referenced, after codecs), chunks, data files, codecs, how it was stored lossily (None:
    exactly), the chunk grid as saved, the ranks that wrote it, and with ``stats`` min / max / mean / std / nan /
    inf of its values."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    chunks: int
    files: int
    codecs: tuple[str, ...]
    lossy: str | None
    layout: str = "whole"                  # the chunk grid as saved: "dim 0 in 2 (cut at 6)", or "whole"
    ranks: tuple[int, ...] = ()            # the ranks whose files hold the chunks
    stats: dict[str, float] | None = None


def layout(entry: Any) -> str:
    """The chunk grid a tensor was saved in, per dimension cut: "dim 0 in 4 (cut at 256, 512, 768)"; "whole"
    for one chunk. Shards of the saving layout and the ≤ 16 MiB pieces they were cut into both show."""
    parts = []
    for d in range(len(entry.shape)):
        cuts = sorted({c.offsets[d] for c in entry.chunks} - {0})
        if cuts:
            shown = ", ".join(str(x) for x in cuts[:4]) + (", …" if len(cuts) > 4 else "")
            parts.append(f"dim {d} in {len(cuts) + 1} (cut at {shown})")
    return "; ".join(parts) or "whole"


def writer_ranks(entry: Any) -> tuple[int, ...]:
    """The ranks that wrote the chunks (data files are named ``r<rank>.bin``)."""
    found = (re.search(r"/r(\d+)\.bin$", c.file) for c in entry.chunks)
    return tuple(sorted({int(x.group(1)) for x in found if x}))


def _stats(read: Callable[[Any], torch.Tensor], entry: Any, slab_bytes: int) -> dict[str, float]:
    """min / max / mean / std of the finite values and NaN / Inf counts, over slabs ``read(box)`` returns."""
    n = nan = inf = 0
    total = sq = 0.0
    lo, hi = math.inf, -math.inf
    for box in slabs(entry, slab_bytes):
        t = read(box)
        if t.is_complex():
            t = t.abs()
        x = t.to(torch.float64).reshape(-1)
        bad_nan, bad_inf = torch.isnan(x), torch.isinf(x)
        nan += int(bad_nan.sum())
        inf += int(bad_inf.sum())
        ok = x[~(bad_nan | bad_inf)]
        if ok.numel():
            lo, hi = min(lo, float(ok.min())), max(hi, float(ok.max()))
            total += float(ok.sum())
            sq += float((ok * ok).sum())
            n += ok.numel()
    mean = total / n if n else math.nan
    var = max(0.0, sq / n - mean * mean) if n else math.nan
    return {"min": lo if n else math.nan, "max": hi if n else math.nan, "mean": mean, "std": math.sqrt(var),
            "nan": nan, "inf": inf}


def describe(path: str | os.PathLike[str], keys: Sequence[str] | None = None, *, stats: bool = False,
             slab_bytes: int = 64 << 20) -> list[KeyInfo]:
    """The tensors of a checkpoint selected by ``keys`` (keys, key prefixes or globs: ``formats.base.matches``): how each is stored, and with ``stats`` its
    min / max / mean / std over the finite values and its NaN / Inf counts (read and verified in slabs). ``path``
    may also be a DCP folder, a safetensors folder/file or a ``torch.save`` file (nothing to verify there)."""
    from liferaft.tools._source import detect, open_source

    if detect(path) != "liferaft":
        return describe_side(open_source(path, keys), stats, slab_bytes)
    storage = with_references(resolve(path))
    m = open_checkpoint(storage)
    picked = [e for e in m.tensors if matches(e.key, keys)]
    if stats:
        check_files(storage, m, {c.file for e in picked for c in e.chunks})
    out = []
    for e in picked:
        codecs = sorted({c.codec or "raw" for c in e.chunks} | ({"xor-delta"} if any(c.delta for c in e.chunks)
                                                                 else set()))
        lossy = None if e.lossy is None else str(e.lossy.get("method"))
        out.append(KeyInfo(key=e.key, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes,
                           stored_bytes=sum(c.stored_length for c in e.chunks if not c.is_reference),
                           chunks=len(e.chunks), files=len({c.file for c in e.chunks}), codecs=tuple(codecs),
                           lossy=lossy, layout=layout(e), ranks=writer_ranks(e),
                           stats=_stats(lambda box, e=e: read_box(storage, e, box, 32 << 20), e, slab_bytes)
                           if stats else None))
    return out


def describe_side(side: Any, stats: bool = False, slab_bytes: int = 64 << 20) -> list[KeyInfo]:
    """``describe`` of a checkpoint in another format (``tools.formats.open_source``): a DCP folder (its chunks: the
    layout and ranks that saved it), a safetensors folder/file or a ``torch.save`` file (one whole chunk each)."""
    out = []
    for key, (dtype, shape, _) in side.tensors.items():
        itemsize = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
        cs = side.chunks.get(key) or [SimpleNamespace(offsets=(0,) * len(shape), file=side.url, transforms=())]
        entry = SimpleNamespace(shape=shape, itemsize=itemsize, chunks=cs)
        found = (re.search(r"__(\d+)_\d+\.distcp$", c.file) for c in cs)
        nbytes = math.prod(shape) * itemsize
        out.append(KeyInfo(key=key, dtype=dtype, shape=tuple(shape), nbytes=nbytes, stored_bytes=nbytes,
                           chunks=len(cs), files=len({c.file for c in cs}),
                           codecs=tuple(sorted({"+".join(c.transforms) or "raw" for c in cs})), lossy=None,
                           layout=layout(entry), ranks=tuple(sorted({int(x.group(1)) for x in found if x})),
                           stats=_stats(lambda box, k=key: side.read(k, box), entry, slab_bytes) if stats else None))
    return out
