"""``Sharded``: a hand-made (Megatron-style) shard of a global tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from liferaft.errors import InvalidStateError


@dataclass(frozen=True, init=False)
class Sharded:
    """``local`` holds the box of a global tensor of ``global_shape`` that starts at ``offsets``.

    Several ranks may hold the same box (replicas): it is written once. On load the box is filled in place
    from whatever chunks were saved, whatever layout wrote them.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> None:
        if not isinstance(local, torch.Tensor):
            raise InvalidStateError(f"Sharded.local must be a torch.Tensor, got {type(local).__qualname__}")
        gs, off = tuple(int(x) for x in global_shape), tuple(int(x) for x in offsets)
        if not (len(gs) == len(off) == local.dim()):
            raise InvalidStateError(
                f"Sharded: local tensor is {local.dim()}-d but global_shape {list(gs)} and offsets {list(off)} "
                "must have one entry per dimension")
        for d, (o, n, g) in enumerate(zip(off, local.shape, gs)):
            if o < 0 or o + n > g:
                raise InvalidStateError(
                    f"Sharded: dim {d}: local size {n} at offset {o} does not fit in global size {g}")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", off)
