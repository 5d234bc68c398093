"""Stage recovery without a checkpoint (CheckFree, opt-in, lossy): ``liferaft.rebuild_stage``, docs/CHECKFREE.md.

When a pipeline stage's node is lost and no recent copy of it exists, CheckFree (Blagoev, Ersoy, Chen, 2025)
rebuilds the stage from its neighbours: stage ``i``'s weights become a weighted average of stage ``i − 1``'s and
``i + 1``'s (the stages of a transformer pipeline hold the same blocks, so their tensors have the same names and
shapes), and training goes on. The result is not the lost state: it is an approximation that the next steps train
back, and every later checkpoint of the job says so (``CheckpointManager.mark_lossy``).

``rebuild_stage`` is collective over the pipeline's process group, whose rank ``i`` holds stage ``i`` (one rank per
stage: the stage's module holds plain tensors; a stage sharded further, by DTensor, is refused). Every rank calls it;
the ranks that lost their stage pass ``lost=True`` (their module freshly built, any values). Each lost stage takes
the average of its live neighbours (one neighbour for the first and the last stage, or when a neighbour is lost
too: a copy of it), weighted by the norms of the neighbours' last gradients (``weights="grad-norm"``: a stage
still learning fast counts more; equal weights where no gradient is present) or equally (``"equal"``). Floating
tensors are averaged in float64 and cast back; others (integer buffers) are taken from the first neighbour. The
lost stage's optimizer state, if its optimizer is given, is cleared (its moments belonged to the lost weights).
Before anything is sent the ranks check every lost stage against its neighbours (names, shapes, dtypes) and raise
``InvalidStateError`` on every rank naming the first difference; a lost stage with no live neighbour raises too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from liferaft.dist import Coordinator
from liferaft.errors import InvalidStateError, OptionsError
from liferaft.state.optsteps import is_dtensor


@dataclass(frozen=True)
class StageRebuild:
    """What ``rebuild_stage`` did: each lost stage, the stages it was averaged from and their weights, and the
    tensors rebuilt (the same report on every rank)."""

    rebuilt: tuple[tuple[int, tuple[int, ...], tuple[float, ...]], ...]
    tensors: int

    def describe(self) -> str:
        """One line for logs and for the checkpoints' ``lossy_state``."""
        return "; ".join(f"stage {s} rebuilt from stage(s) {', '.join(map(str, src))} (weights "
                         f"{', '.join(f'{w:.3f}' for w in ws)})" for s, src, ws in self.rebuilt)


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        if is_dtensor(t) or is_dtensor(t.data):
            raise InvalidStateError(f"rebuild_stage: {name} is a DTensor; a stage's module must hold plain tensors "
                                    "(one rank per stage)")
        out.append((name, t))
    return out


def _grad_norm(module: torch.nn.Module) -> float:
    total = 0.0
    for p in module.parameters():
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return math.sqrt(total)


def rebuild_stage(module: torch.nn.Module, *, lost: bool, optimizer: torch.optim.Optimizer | None = None,
                  weights: Literal["grad-norm", "equal"] = "grad-norm", process_group: Any = None,
                  timeout: float = 600.0) -> StageRebuild:
    """Rebuild the lost pipeline stages from their neighbours (module docstring; collective over
    ``process_group``, rank ``i`` = stage ``i``). Returns the same report on every rank; the rebuilt state is an
    approximation — pass the report's ``describe()`` to ``CheckpointManager.mark_lossy``."""
    if weights not in ("grad-norm", "equal"):
        raise OptionsError(f"rebuild_stage: weights must be 'grad-norm' or 'equal', got {weights!r}")
    coord = Coordinator(process_group, timeout, channel="checkfree")
    mine = _tensors(module)
    sig = [(n, tuple(t.shape), str(t.dtype)) for n, t in mine]
    norm = 0.0 if lost else _grad_norm(module)
    everyone: list[tuple[bool, list[Any], float]] = coord.exchange((bool(lost), sig, norm), None,
                                                                   "rebuild_stage (stages)")
    plan = _plan(everyone, weights)
    me = coord.rank
    for stage, sources, ws in plan:                 # sources send in stage order; each lost stage receives
        if me in sources:
            for _, t in mine:
                coord.isend(t.detach().cpu().contiguous(), stage, 0).wait()     # (gloo: host memory)
        elif me == stage:
            got = []
            for src in sources:
                bufs = [torch.empty(t.shape, dtype=t.dtype) for _, t in mine]
                for buf in bufs:
                    coord.irecv(buf, src, 0).wait()
                got.append(bufs)
            average(got, ws, [t for _, t in mine])
            if optimizer is not None:
                for p in module.parameters():
                    optimizer.state.pop(p, None)
    coord.exchange(None, None, "rebuild_stage (done)")
    return StageRebuild(rebuilt=tuple(plan), tensors=len(mine))


def average(sources: Sequence[Sequence[torch.Tensor]], weights: Sequence[float],
            into: Sequence[torch.Tensor]) -> None:
    """Set each tensor of ``into`` to the ``weights``-weighted sum of the same position in each of ``sources``
    (floating tensors, summed in float64 in source order and cast back), or to the first source's (others).
    The arithmetic of ``rebuild_stage``, for a pipeline simulated in one process."""
    with torch.no_grad():
        for k, t in enumerate(into):
            if t.is_floating_point():
                acc = torch.zeros(t.shape, dtype=torch.float64)
                for src, w in zip(sources, weights):
                    acc.add_(src[k].double(), alpha=w)
                t.copy_(acc)
            else:
                t.copy_(sources[0][k])


def _plan(everyone: Sequence[tuple[bool, list[Any], float]],
          weights: str) -> list[tuple[int, tuple[int, ...], tuple[float, ...]]]:
    """Per lost stage: (stage, its live neighbours, their normalized weights), checked. Pure: the same on every
    rank."""
    n = len(everyone)
    out = []
    for i, (lost, sig, _) in enumerate(everyone):
        if not lost:
            continue
        sources = tuple(j for j in (i - 1, i + 1) if 0 <= j < n and not everyone[j][0])
        if not sources:
            raise InvalidStateError(f"rebuild_stage: stage {i} is lost and has no live neighbour stage to be rebuilt "
                                    "from; restore it from a checkpoint")
        for j in sources:
            other = everyone[j][1]
            if other != sig:
                diff = next((f"{a} vs {b}" for a, b in zip(sig, other) if a != b), f"{len(sig)} tensors vs {len(other)}")
                raise InvalidStateError(f"rebuild_stage: stage {i} and its neighbour stage {j} do not hold the same "
                                        f"tensors ({diff}): CheckFree needs stages of the same blocks")
        raw = [everyone[j][2] for j in sources] if weights == "grad-norm" else [1.0] * len(sources)
        if not all(math.isfinite(w) and w > 0 for w in raw):
            raw = [1.0] * len(sources)
        total = sum(raw)
        out.append((i, sources, tuple(w / total for w in raw)))
    return out


__all__ = ["StageRebuild", "average", "rebuild_stage"]
