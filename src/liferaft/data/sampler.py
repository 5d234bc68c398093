"""A data order that survives a change of the data-parallel size: one global sample stream, cut per rank.

The stream is a pure function of ``seed`` and the position: position ``p`` draws from source ``s(p)`` (chosen by
weight with a counter-based hash of ``(seed, p)``) its ``k``-th sample, where ``k`` counts the earlier positions
that drew from ``s``; the ``k``-th sample of a source is element ``k mod n`` of a permutation of its ``n`` items
seeded by ``(seed, source, k // n)`` (one reshuffle per pass over the source). Global batch ``b`` is positions
``[b·B, (b+1)·B)``; rank ``r`` of ``W`` takes its contiguous share of it. The state is therefore global and tiny
— the position reached and how many samples each source has given — identical on every rank (saved once), and a
resume on any number of ranks continues the same global order: no sample skipped, none repeated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from liferaft.errors import OptionsError, StateMismatchError

_MASK = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays: a counter-based hash, the same on every platform."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _seed_of(*parts: int) -> int:
    h = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            h = _mix64(h ^ np.uint64(p & _MASK))
    return int(h[0])


@dataclass(frozen=True)
class Sample:
    """One sample of the global stream: ``index`` within ``source``; ``flat`` its index in the sources laid out
    one after the other (what a ``torch.utils.data.ConcatDataset`` of the sources takes)."""

    source: str
    index: int
    flat: int


class GlobalSampler:
    """This rank's share of a global, data-parallel-size-independent sample stream (see the module doc).

    ``sources``: name → number of items (several sources are mixed by ``weights``, default by size).
    ``global_batch_size``: samples per global batch, cut into ``world`` contiguous shares (the first
    ``global_batch_size % world`` ranks take one more). Iterating yields this rank's share of each next global
    batch as a list of ``Sample`` (``batches()``) or of flat indices (``iter(sampler)``: a ``batch_sampler`` for a
    DataLoader over the concatenated sources) and advances the state by one global batch. ``state_dict()`` /
    ``load_state_dict()`` hold the global position; ``set_rank(rank, world)`` moves to another layout.

    With a DataLoader that prefetches (``num_workers > 0``), the sampler runs ahead of training: save
    ``state_dict(batches_trained=n)``, the state after the first ``n`` batches handed out since the state was last
    loaded (or since the start), not the sampler's own position.
    """

    def __init__(self, sources: Mapping[str, int], *, global_batch_size: int, weights: Mapping[str, float] | None = None,
                 seed: int = 0, rank: int = 0, world: int = 1) -> None:
        if not sources or any(n < 1 for n in sources.values()):
            raise OptionsError("GlobalSampler needs at least one source, each with at least one item")
        if global_batch_size < 1:
            raise OptionsError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.names = tuple(sources)
        self.sizes = np.array([sources[n] for n in self.names], dtype=np.int64)
        w = np.array([float((weights or sources)[n]) for n in self.names])
        if weights is not None and set(weights) != set(sources):
            raise OptionsError(f"weights must name the same sources: {sorted(weights)} vs {sorted(sources)}")
        if (w <= 0).any():
            raise OptionsError("every source weight must be > 0")
        self._cum = np.cumsum(w / w.sum())
        self._cum[-1] = 1.0
        self._offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.position = 0                                   # global samples handed out
        self.counts = np.zeros(len(self.names), dtype=np.int64)   # per source, at ``position``
        self._history: list[tuple[int, np.ndarray]] = []    # (position, counts) after each batch handed out
        self._start: tuple[int, np.ndarray] = (0, self.counts.copy())   # where the history starts
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.set_rank(rank, world)

    # ------------------------------------------------------------------ layout and state

    def set_rank(self, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise OptionsError(f"rank {rank} is not in 0..{world - 1}")
        if world > self.global_batch_size:
            raise OptionsError(f"a global batch of {self.global_batch_size} cannot be shared by {world} ranks")
        self.rank, self.world = rank, world

    def state_dict(self, batches_trained: int | None = None) -> dict[str, Any]:
        """The global state: after all batches handed out, or after the first ``batches_trained`` of them since
        the last ``load_state_dict`` (or the start). The same on every rank."""
        position, counts = self.position, self.counts
        if batches_trained is not None:
            if not 0 <= batches_trained <= len(self._history):
                raise OptionsError(f"batches_trained={batches_trained}, but {len(self._history)} batches were "
                                   "handed out since the state was loaded")
            position, counts = self._history[batches_trained - 1] if batches_trained else self._start
        return {"position": int(position), "counts": {n: int(c) for n, c in zip(self.names, counts)},
                "seed": self.seed, "sources": {n: int(s) for n, s in zip(self.names, self.sizes)},
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (same sources and seed; any rank count; a different global batch size is allowed
        and takes effect from here)."""
        if dict(state["sources"]) != {n: int(s) for n, s in zip(self.names, self.sizes)} or state["seed"] != self.seed:
            raise StateMismatchError(f"data sampler state is for sources {dict(state['sources'])} with seed "
                                     f"{state['seed']}, not {dict(zip(self.names, self.sizes.tolist()))} with seed "
                                     f"{self.seed}")
        self.position = int(state["position"])
        self.counts = np.array([int(state["counts"][n]) for n in self.names], dtype=np.int64)
        self._start = (self.position, self.counts.copy())
        self._history.clear()

    # ------------------------------------------------------------------ the stream

    def _sources_at(self, start: int, n: int) -> np.ndarray:
        pos = np.arange(start, start + n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = _mix64(pos * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(self.seed & _MASK))
        return np.searchsorted(self._cum, (u >> np.uint64(11)).astype(np.float64) / float(1 << 53), side="right")

    def _perm(self, src: int, epoch: int) -> np.ndarray:
        key = (src, epoch)
        p = self._perms.get(key)
        if p is None:
            if len(self._perms) > 4 * len(self.names):
                self._perms.clear()
            p = np.random.Generator(np.random.PCG64(_seed_of(self.seed, src, epoch))).permutation(int(self.sizes[src]))
            self._perms[key] = p
        return p

    def _next_global(self) -> list[Sample]:
        """Advance by one global batch; return this rank's share."""
        b = self.global_batch_size
        src = self._sources_at(self.position, b)
        counts = self.counts.copy()
        ks = np.empty(b, dtype=np.int64)
        for i, s in enumerate(src):
            ks[i] = counts[s]
            counts[s] += 1
        share, extra = divmod(b, self.world)
        lo = self.rank * share + min(self.rank, extra)
        hi = lo + share + (1 if self.rank < extra else 0)
        out = []
        for s, k in zip(src[lo:hi], ks[lo:hi]):
            n = int(self.sizes[s])
            idx = int(self._perm(int(s), int(k) // n)[int(k) % n])
            out.append(Sample(self.names[s], idx, int(self._offsets[s]) + idx))
        self.position += b
        self.counts = counts
        self._history.append((self.position, counts.copy()))
        return out

    def batches(self) -> Iterator[list[Sample]]:
        """This rank's share of each next global batch, without end."""
        while True:
            yield self._next_global()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield [s.flat for s in self._next_global()]


def global_order(shares_per_rank: Sequence[Sequence[Sample]]) -> list[tuple[str, int]]:
    """One global batch from the ranks' shares, in rank order (for tests and tools)."""
    return [(s.source, s.index) for share in shares_per_rank for s in share]
