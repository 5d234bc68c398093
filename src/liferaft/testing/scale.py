"""Simulated rank metadata for measuring and testing the planners at a scale no test can run
(``benchmarks/bench_scale.py``, ``tests/unit/test_plan_scale.py``)."""

from __future__ import annotations

from liferaft.planning.layouts import Layout
from liferaft.planning.save_plan import RankMeta, TensorMeta

#: the columns of every simulated tensor (fp32)
COLS = 4096
LAYOUTS = ("fsdp", "fsdp×tp8", "pairs", "ddp")


def rank_metas(layout: str, ranks: int, tensors: int, rows: int) -> list[RankMeta]:
    """What each of ``ranks`` ranks holds of ``tensors`` tensors of ``max(rows, ranks)`` × ``COLS`` fp32:
    ``fsdp`` — ``Shard(0)`` over all ranks; ``fsdp×tp8`` — ``Shard(0)`` over ranks / 8 × ``Shard(1)`` over 8;
    ``pairs`` — row shards over ranks / 2, each held by 2 ranks; ``ddp`` — every rank holds every tensor whole."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rows = max(rows, ranks)
    out = []
    for r in range(ranks):
        if layout == "fsdp":
            lo, hi = r * rows // ranks, (r + 1) * rows // ranks
            box = ((lo, 0), (hi - lo, COLS))
        elif layout == "fsdp×tp8":
            dp, tp = ranks // 8, 8
            i, j = r // tp, r % tp
            lo, hi = i * rows // dp, (i + 1) * rows // dp
            box = ((lo, j * COLS // tp), (hi - lo, COLS // tp))
        elif layout == "pairs":
            half = ranks // 2
            lo, hi = (r % half) * rows // half, (r % half + 1) * rows // half
            box = ((lo, 0), (hi - lo, COLS))
        else:
            box = ((0, 0), (rows, COLS))
        metas = tuple(TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor",
                                 dtype="float32", shape=(rows, COLS), boxes=(box,)) for t in range(tensors))
        out.append(RankMeta(rank=r, tensors=metas, values=(), containers=()))
    return out


def compact_tensors(layout: str, ranks: int, tensors: int, rows: int) -> list[tuple[TensorMeta, Layout]] | None:
    """The same tensors as :func:`rank_metas`, each with its compact layout (``planning.layouts``): what every
    rank describes when it plans its own writes; None for ``pairs`` (hand-made shards have no compact layout).
    The row split is DTensor's (``ceil(rows / parts)`` each), equal to ``rank_metas``' when the parts divide the
    rows."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "pairs":
        return None
    rows = max(rows, ranks)
    how = {"fsdp": Layout((ranks,), (0,)), "fsdp×tp8": Layout((ranks // 8, 8), (0, 1)),
           "ddp": Layout((ranks,), (None,))}[layout]
    return [(TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor", dtype="float32",
                        shape=(rows, COLS), boxes=()), how) for t in range(tensors)]
