"""Simulated rank metadata for measuring and testing the planners at a scale no test can run
(``benchmarks/bench_scale.py``, ``tests/unit/test_plan_scale.py``)."""

from __future__ import annotations

from liferaft.planning.layouts import Layout
from liferaft.planning.save_plan import RankMeta, TensorMeta

#: the columns of every simulated tensor (fp32)
COLS = 4096
LAYOUTS = ("fsdp", "fsdp×tp8", "pairs", "ddp")
#: pipeline stages: 16 stages, each holding its own tensors (a sixteenth of them), each ``Shard(0)`` over the
#: stage's ranks (FSDP2 on the stage's sub-mesh), with a plain step count per tensor the stage holds whole
STAGES = 16


def stage_of(ranks: int, tensors: int, t: int) -> int:
    """The stage holding tensor ``t`` in the ``pp16`` layout."""
    return t * STAGES // tensors


def stage_tensors(ranks: int, tensors: int, rows: int, rank: int) -> tuple[TensorMeta, ...]:
    """What ``rank`` holds in the ``pp16`` layout: its stage's weights' row blocks (``Shard(0)`` over its stage's
    ranks) and step counts (plain tensors its stage holds whole), in tensor order."""
    dp = ranks // STAGES
    stage, i = divmod(rank, dp)
    rows = max(rows, ranks)
    lo, hi = i * rows // dp, (i + 1) * rows // dp
    out = []
    for t in range(tensors):
        if stage_of(ranks, tensors, t) == stage:
            out.append(TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor",
                                  dtype="float32", shape=(rows, COLS), boxes=(((lo, 0), (hi - lo, COLS)),)))
            out.append(TensorMeta(key=f"layers.{t}.step", path=("layers", str(t), "step"), kind="tensor",
                                  dtype="float32", shape=(), boxes=(((), ()),)))
    return tuple(out)


def rank_metas(layout: str, ranks: int, tensors: int, rows: int) -> list[RankMeta]:
    """What each of ``ranks`` ranks holds of ``tensors`` tensors of ``max(rows, ranks)`` × ``COLS`` fp32:
    ``fsdp`` — ``Shard(0)`` over all ranks; ``fsdp×tp8`` — ``Shard(0)`` over ranks / 8 × ``Shard(1)`` over 8;
    ``pairs`` — row shards over ranks / 2, each held by 2 ranks; ``ddp`` — every rank holds every tensor whole;
    ``pp16`` — pipeline stages (:func:`stage_tensors`)."""
    if layout not in LAYOUTS + ("pp16",):
        raise ValueError(f"layout must be one of {LAYOUTS + ('pp16',)}, got {layout!r}")
    if layout == "pp16":
        return [RankMeta(rank=r, tensors=stage_tensors(ranks, tensors, rows, r), values=(), containers=())
                for r in range(ranks)]
    out = []
    for r in range(ranks):
        box = rank_box(layout, ranks, rows, r)
        metas = tuple(TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor",
                                 dtype="float32", shape=(max(rows, ranks), COLS), boxes=(box,))
                      for t in range(tensors))
        out.append(RankMeta(rank=r, tensors=metas, values=(), containers=()))
    return out


def rank_box(layout: str, ranks: int, rows: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The box rank ``r`` holds of every tensor in :func:`rank_metas`."""
    rows = max(rows, ranks)
    if layout == "fsdp":
        lo, hi = r * rows // ranks, (r + 1) * rows // ranks
        return (lo, 0), (hi - lo, COLS)
    if layout == "fsdp×tp8":
        dp, tp = ranks // 8, 8
        i, j = r // tp, r % tp
        lo, hi = i * rows // dp, (i + 1) * rows // dp
        return (lo, j * COLS // tp), (hi - lo, COLS // tp)
    if layout == "pairs":
        half = ranks // 2
        lo, hi = (r % half) * rows // half, (r % half + 1) * rows // half
        return (lo, 0), (hi - lo, COLS)
    return (0, 0), (rows, COLS)


def compact_tensors(layout: str, ranks: int, tensors: int, rows: int) -> list[tuple[TensorMeta, Layout]]:
    """The same tensors as :func:`rank_metas`, each with its compact layout (``planning.layouts``): what every
    rank describes when it plans its own writes (for ``pairs``, hand-made shards, the layout the save infers
    from the probes' boxes: ``planning.layouts.infer_layout``; for ``pp16``, every stage's tensors with their layouts
    scoped to the stage, as ``planning.stages.stage_layouts`` gives them). The row split is DTensor's
    (``ceil(rows / parts)`` each), equal to ``rank_metas``' when the parts divide the rows."""
    if layout not in LAYOUTS + ("pp16",):
        raise ValueError(f"layout must be one of {LAYOUTS + ('pp16',)}, got {layout!r}")
    rows = max(rows, ranks)
    if layout == "pp16":            # (every stage's tensors, scoped to the stage: ``planning.stages``)
        dp = ranks // STAGES
        groups = [tuple(range(s * dp, (s + 1) * dp)) for s in range(STAGES)]
        out = []
        for t in range(tensors):
            s = stage_of(ranks, tensors, t)
            out.append((TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor",
                                   dtype="float32", shape=(rows, COLS), boxes=()),
                        Layout((STAGES, dp), (None, 0), at=(s, None))))
            out.append((TensorMeta(key=f"layers.{t}.step", path=("layers", str(t), "step"), kind="tensor",
                                   dtype="float32", shape=(), boxes=()),
                        Layout((ranks,), (None,), group=groups[s])))
        return out
    how = {"pairs": Layout((2, ranks // 2), (None, 0)),"fsdp": Layout((ranks,), (0,)), "fsdp×tp8": Layout((ranks // 8, 8), (0, 1)),
           "ddp": Layout((ranks,), (None,))}[layout]
    return [(TensorMeta(key=f"layers.{t}.weight", path=("layers", str(t), "weight"), kind="tensor", dtype="float32",
                        shape=(rows, COLS), boxes=()), how) for t in range(tensors)]
