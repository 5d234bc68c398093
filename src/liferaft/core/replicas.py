"""The copies of tensors that are replicas by a sub-mesh alone, compared before a save writes anything.

A DTensor on a sub-mesh (FSDP2 on ``mesh["dp"]`` of a (pp, dp) mesh) is described over its root mesh, replicated
along the root's dimensions the sub-mesh lacks: the DTensor contract says the ranks there hold the same tensor,
so a save writes each chunk from one of them. Pipeline stages that name their layers alike (each stage's first
layer ``layers.0``) break that contract silently: their boxes look like replicas, and the checkpoint would hold one
tensor pieced from every stage. So these copies are compared (:func:`same_replicas`): by a sample of each of a
rank's boxes (three rows along the first dimension, or three windows of a 1-D box, at most 16 KiB, with the box's
offsets), which tells different tensors apart at a cost that does not grow with the model, not bit-level
divergence of true replicas (which the contract takes on trust, as PyTorch DCP does). Tensors replicated by a ``Replicate`` placement or held whole by
modules (DDP, HSDP, BatchNorm's statistics) are not compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from liferaft.codecs.checksum import digest
from liferaft.core.described import tensor_digest
from liferaft.dist import Coordinator
from liferaft.errors import InvalidStateError
from liferaft.state.flatten import FlatState

#: the bits of each of the two hashes a rank adds per tensor: the sums stay below 2**63 for any world up to 2**18
#: (each of at most world holders adds at most world × 2**26)
_BITS = 26
#: the most bytes of a box hashed (its first, middle and last rows along dimension 0, then the first bytes of those)
SAMPLE_BYTES = 16 << 10


def sample_digest(t: torch.Tensor, offsets: Sequence[int]) -> int:
    """A 64-bit digest of a sample of the box ``t`` (at ``offsets`` in its tensor), with its shape and offsets: of
    a 1-D box, three windows (its start, middle and end); else a leading corner of its first, middle and last rows
    along dimension 0; at most :data:`SAMPLE_BYTES` in all, read by narrowing (no copy of the box, any dtype)."""
    x = t.detach()
    keep = max(1, SAMPLE_BYTES // max(1, x.element_size()))
    if x.dim() == 0 or x.numel() == 0:
        pieces = [x]
    elif x.dim() == 1:
        w = min(x.shape[0], max(1, keep // 3))
        pieces = [x.narrow(0, s, w) for s in sorted({0, (x.shape[0] - w) // 2, x.shape[0] - w})]
    else:
        rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
        pieces = []
        for r in rows:
            p, budget = x.narrow(0, r, 1), max(1, keep // len(rows))
            for d in range(1, p.dim()):
                p = p.narrow(d, 0, min(p.shape[d], budget))
                budget = max(1, budget // max(1, p.shape[d]))
            pieces.append(p)
    return int(digest(repr((tuple(offsets), tuple(t.shape), [tensor_digest(p) for p in pieces])).encode()), 16)


def same_replicas(coord: Coordinator, flat: FlatState, keys: Sequence[str],
                  holders_of: Callable[[str], tuple[int, ...] | None]) -> None:
    """(Collective: ``keys`` the same on every rank) Refuse, on every rank, a save in which a tensor of ``keys``
    differs between ranks holding the same box of it (``holders_of(key)``: the ranks holding this rank's box,
    None when it holds none). One all-reduce (a sum) of two numbers per tensor: each rank adds two
    :data:`_BITS`-bit hashes of its box's sample (:func:`sample_digest`), times the number of holders on the box's
    first holder, minus once on every holder, so equal copies sum to 0 (a difference cancels only by chance, one
    in 2**52). A rank whose hashing fails says so on the same all-reduce: every rank raises, none waits. Nothing
    when ``keys`` is empty."""
    if not keys:
        return
    parts = {t.key: t.parts for t in flat.tensors}
    votes, error = [0], None
    mask = (1 << _BITS) - 1
    try:
        for key in keys:
            holders = holders_of(key) if key in parts else None
            if not holders:
                votes += [0, 0]
                continue
            # (every box of this rank's shard: a _StridedShard's local tensor holds several)
            h = int(digest(repr([sample_digest(local, box[0]) for box, local in parts[key]]).encode()), 16)
            for u in (h & mask, (h >> _BITS) & mask):
                votes.append((len(holders) * u if holders[0] == coord.rank else 0) - u)
    except Exception as e:  # noqa: BLE001 - said on the all-reduce, then raised here
        votes, error = [1] + [0] * (2 * len(keys)), e
    sums = coord.all_sum(votes, "save (planning): the copies of replicas implied by a sub-mesh")
    if error is not None:
        raise error
    if sums[0]:
        raise InvalidStateError("a rank failed to compare its copies of the tensors replicated by a sub-mesh (its "
                                "error says why); nothing was written")
    bad = [k for n, k in enumerate(keys) if sums[1 + 2 * n] or sums[2 + 2 * n]]
    if bad:
        raise InvalidStateError(
            f"key(s) {bad[:5]} differ between ranks that hold the same box of them as replicas of a DTensor's "
            "sub-mesh (ranks of several pipeline stages, or of the root mesh outside the sub-mesh): stages that "
            "name their layers alike (each stage's first layer 'layers.0') would be saved as one tensor pieced "
            "from every stage. Name each stage's parameters distinctly (as torchtitan's pipeline split keeps the "
            "model's names), or keep tied weights in sync; nothing was written")
