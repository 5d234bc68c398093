"""``Sharded``: a hand-made (Megatron-style) shard of a global tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from liferaft.errors import InvalidStateError


@dataclass(frozen=True, init=False)
class Sharded:
    """``local`` holds the box of a global tensor of ``global_shape`` that starts at ``offsets``.

    ``more`` lists further boxes the same rank holds, as ``(offsets, tensor)`` pairs (e.g. several experts of a
    stacked expert weight, or the chunks of a checkpoint written by another layout); a rank's boxes must not
    overlap. Several ranks may hold the same box (replicas): it is written once. On load every box is filled in
    place from whatever chunks were saved, whatever layout wrote them.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    more: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int],
                 more: Sequence[tuple[Sequence[int], torch.Tensor]] = ()) -> None:
        gs = tuple(int(x) for x in global_shape)
        boxes = [(_check(local, gs, offsets, "Sharded"), local)]
        for i, (off, t) in enumerate(more):
            boxes.append((_check(t, gs, off, f"Sharded.more[{i}]"), t))
            if t.dtype != local.dtype:
                raise InvalidStateError(f"Sharded.more[{i}] is {t.dtype} but local is {local.dtype}; one dtype")
        for i in range(len(boxes)):
            for j in range(i):
                if _overlap(boxes[i][0], tuple(boxes[i][1].shape), boxes[j][0], tuple(boxes[j][1].shape)):
                    raise InvalidStateError(f"Sharded: boxes at offsets {list(boxes[j][0])} and {list(boxes[i][0])} "
                                            "overlap; a rank's boxes must be disjoint")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", boxes[0][0])
        object.__setattr__(self, "more", tuple(boxes[1:]))

    def boxes(self) -> list[tuple[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]]:
        """Every box this rank holds as ``((offsets, sizes), tensor)``, ``local`` first."""
        return [((off, tuple(t.shape)), t) for off, t in ((self.offsets, self.local),) + self.more]


def _check(local: object, gs: tuple[int, ...], offsets: Sequence[int], what: str) -> tuple[int, ...]:
    if not isinstance(local, torch.Tensor):
        raise InvalidStateError(f"{what} must be a torch.Tensor, got {type(local).__qualname__}")
    off = tuple(int(x) for x in offsets)
    if not (len(gs) == len(off) == local.dim()):
        raise InvalidStateError(
            f"{what}: local tensor is {local.dim()}-d but global_shape {list(gs)} and offsets {list(off)} "
            "must have one entry per dimension")
    for d, (o, n, g) in enumerate(zip(off, local.shape, gs)):
        if o < 0 or o + n > g:
            raise InvalidStateError(f"{what}: dim {d}: local size {n} at offset {o} does not fit in global size {g}")
    return off


def _overlap(a: tuple[int, ...], an: tuple[int, ...], b: tuple[int, ...], bn: tuple[int, ...]) -> bool:
    return all(x < y + m and y < x + n for x, n, y, m in zip(a, an, b, bn)) and 0 not in an and 0 not in bn
