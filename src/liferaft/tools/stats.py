"""Per-tensor summary statistics of a checkpoint of any format, computed streaming (row slabs), and the storage
view of each key (chunks, files, stored bytes, codecs, lossy, writing ranks): ``liferaft inspect --stats``
(docs/cli/inspect.md). Everything comes through the reader protocol (``formats.base.Reader``: ``chunks``,
``check_present``, ``plan``), whatever the format."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from liferaft.core.open import in_call, open_reader
from liferaft.formats.base import Box, ChunkInfo, Reader, select
from liferaft.formats.dcp import DcpReader
from liferaft.tools._slabs import itemsize, read_box, slabs


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


def layout(shape: Sequence[int], chunks: Sequence[ChunkInfo]) -> str:
    """The chunk grid a tensor was saved in, per dimension cut: "dim 0 in 4 (cut at 256, 512, 768)"; "whole"
    for one chunk. Shards of the saving layout and the ≤ 16 MiB pieces they were cut into both show."""
    parts = []
    for d in range(len(shape)):
        cuts = sorted({c.offsets[d] for c in chunks} - {0})
        if cuts:
            shown = ", ".join(str(x) for x in cuts[:4]) + (", …" if len(cuts) > 4 else "")
            parts.append(f"dim {d} in {len(cuts) + 1} (cut at {shown})")
    return "; ".join(parts) or "whole"


_DCP_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


def chunks_of(reader: Reader, key: str) -> tuple[ChunkInfo, ...]:
    """``reader.chunks(key)``; for a DCP folder each chunk's own file, its stream transforms as codecs and the
    rank in its file name (``__<rank>_<n>.distcp``), which ``DcpReader`` does not report through ``chunks``."""
    if not isinstance(reader, DcpReader):
        return reader.chunks(key)
    item = itemsize(reader.tensors[key].dtype)
    out = []
    for c in reader.ck.tensors[key].chunks:
        found = _DCP_RANK.search(c.file)
        out.append(ChunkInfo(offsets=c.offsets, sizes=c.sizes, file=c.file, codecs=("+".join(c.transforms) or "raw",),
                             stored_bytes=math.prod(c.sizes) * item, rank=int(found.group(1)) if found else None))
    return tuple(out)


def _stats(read: Callable[[Box], torch.Tensor], boxes: Sequence[Box]) -> dict[str, float]:
    """min / max / mean / std of the finite values and NaN / Inf counts, over the slabs ``read(box)`` returns. The
    variance is merged slab by slab from each slab's count, mean and sum of squared deviations (Chan et al.), so
    values far from zero (1e8 ± 1) keep their spread, which ``E[x²] − E[x]²`` cancels away."""
    n = nan = inf = 0
    mean = m2 = 0.0
    lo, hi = math.inf, -math.inf
    for box in boxes:
        t = read(box)
        if t.is_complex():
            t = t.abs()
        x = t.to(torch.float64).reshape(-1)
        bad_nan, bad_inf = torch.isnan(x), torch.isinf(x)
        nan += int(bad_nan.sum())
        inf += int(bad_inf.sum())
        ok = x[~(bad_nan | bad_inf)]
        k = ok.numel()
        if k:
            lo, hi = min(lo, float(ok.min())), max(hi, float(ok.max()))
            m = float(ok.mean())
            if not math.isfinite(m):            # (finite values whose sum overflows: mean them scaled down)
                m = float((ok / k).sum())
            d = ok - m
            s2 = float((d * d).sum())
            delta = m - mean
            total = n + k
            mean += delta * k / total
            f = delta * math.sqrt(n * k / total)    # (0 for the first slab: no inf * 0)
            m2 += s2 + f * f
            n = total
    var = m2 / n if n else math.nan
    return {"min": lo if n else math.nan, "max": hi if n else math.nan, "mean": mean if n else math.nan,
            "std": math.sqrt(var) if n and math.isfinite(var) else (math.inf if n else math.nan),
            "nan": nan, "inf": inf}


@in_call
def describe(path: str | os.PathLike[str], keys: Sequence[str] | None = None, *, stats: bool = False,
             slab_bytes: int = 64 << 20) -> list[KeyInfo]:
    """The tensors of a checkpoint selected by ``keys`` (keys, key prefixes or globs: ``formats.base.matches``):
    how each is stored, and with ``stats`` its min / max / mean / std over the finite values and its NaN / Inf
    counts (read in slabs; liferaft's verified, its files checked once up front). ``path`` may be a liferaft
    checkpoint, a DCP folder (its chunks: the layout and ranks that saved it), a safetensors folder/file or a
    ``torch.save`` file (one whole chunk each, nothing to verify there)."""
    reader = open_reader(path, lazy=True)      # (a version 4 checkpoint's tables streamed: only the keys' chunks kept)
    try:
        select(reader.keys, keys, url=reader.url)          # a pattern that selects nothing: OptionsError
        picked = select(list(reader.tensors), keys, required=False)
        streamed: dict[str, list[ChunkInfo]] | None = None
        if not isinstance(reader, DcpReader):   # (``chunks_of``: DCP's own way)
            streamed = {k: [] for k in picked}
            for k, c in reader.chunk_infos(picked):
                streamed[k].append(c)
        if stats:
            reader.check_present(picked)
        return [_key_info(reader, key, stats, slab_bytes, None if streamed is None else streamed[key])
                for key in picked]
    finally:
        reader.close()


def _key_info(reader: Reader, key: str, stats: bool, slab_bytes: int,
              chunks: Sequence[ChunkInfo] | None = None) -> KeyInfo:
    spec = reader.tensors[key]
    chunks = chunks_of(reader, key) if chunks is None else chunks
    item = itemsize(spec.dtype)
    return KeyInfo(key=key, dtype=spec.dtype, shape=tuple(spec.shape), nbytes=spec.nbytes,
                   stored_bytes=sum(c.stored_bytes for c in chunks if not c.referenced),
                   chunks=len(chunks), files=len({c.file for c in chunks}),
                   codecs=tuple(sorted({x for c in chunks for x in c.codecs})),
                   lossy=None if spec.lossy is None else str(spec.lossy.get("method")),
                   layout=layout(spec.shape, chunks),
                   ranks=tuple(sorted({c.rank for c in chunks if c.rank is not None})),
                   stats=_stats(lambda box: read_box(reader, key, box), slabs(spec.shape, item, slab_bytes))
                   if stats else None)
