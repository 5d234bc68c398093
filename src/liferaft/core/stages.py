"""The exchange that plans a save from ranks holding different tensors (pipeline stages: ``planning.stages``).

Each rank's digest of what it describes is gathered to rank 0 (8 bytes a rank), which numbers the classes of ranks
that describe alike and broadcasts them run-length encoded (a run per stage); the first rank of each class sends
rank 0 its tensors and layouts, point to point; rank 0 merges them and broadcasts the result with the save's id.
What a rank other than 0 receives grows with the tensors of every stage (the index's size) and the runs, not with
the ranks times the tensors; rank 0 receives 8 bytes a rank and one description a class. A repeated save whose
ranks all kept the same agreement votes it in the save's first all-reduce and skips all of this
(``caches.STAGED``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from liferaft.core.caches import STAGED
from liferaft.core.described import digest62, layout_digest
from liferaft.core.replicas import same_replicas
from liferaft.dist import Coordinator
from liferaft.errors import InvalidStateError
from liferaft.planning.layouts import Layout, holds, layout_holders
from liferaft.planning.save_plan import RankMeta, TensorMeta
from liferaft.planning.stages import MAX_CLASSES, Staged, classes_of, from_runs, merge_stages, runs, stage_layouts
from liferaft.state.flatten import FlatState

#: the tags of the classes' descriptions sent to rank 0 (``core.phases``'s probes are 0x4C46_0004/5)
DESCRIBE_TAGS = (0x4C46_0006, 0x4C46_0007)


def stage_digest(meta: RankMeta, layouts: tuple[Layout, ...], options: tuple[Any, ...],
                 implied: tuple[int, ...] = ()) -> int:
    """What ranks of one class share (62 bits, never 0): their tensors with their layouts (``layout_digest``
    without the values), their containers and ``options``; not the values of the plain tensors compared across
    ranks (an optimizer's step counts change at every save: their copies are compared by
    :func:`_same_copies`). ``implied``: the positions of the DTensors replicated by a sub-mesh alone (what a
    repeated save compares: ``core.replicas``)."""
    alignment, chunk_bytes, tables, incremental = options
    described = layout_digest(meta, layouts, alignment, chunk_bytes, tables, values=False, implied=implied,
                              incremental=incremental)
    return digest62(repr((described, meta.containers)).encode())


def staged_before(coord: Coordinator) -> bool:
    """Whether this process keeps a plan of stages made over ``coord``'s group (what makes the digest of a
    save's description worth computing before the vote)."""
    return any(k[0] == coord.key for k, _ in STAGED.items())


def known_stages(coord: Coordinator, sig: int) -> int:
    """The digest of every rank's description this rank last agreed on under its description ``sig`` (0: none):
    what a repeated save votes on."""
    found = STAGED.get((coord.key, sig))
    return found[0] if found is not None else 0


def plan_stages(coord: Coordinator, flat: FlatState, meta: RankMeta, layouts: tuple[Layout, ...], sig: int,
                agreed: bool, head: tuple[Any, ...], options: tuple[Any, ...]
                ) -> tuple[tuple[TensorMeta, ...], tuple[Layout, ...], int, Any] | None:
    """(Collective) every tensor of every rank with its layout scoped to the ranks holding it, the digest of every
    rank's description (what the plan is cached by) and rank 0's ``head`` (broadcast: the save's id and its
    values' digests); None when the ranks must plan gathered (the same answer on every rank). ``agreed``: every
    rank voted the same nonzero ``known_stages``, which are then reused without an exchange. ``options``: what
    the plan depends on beyond the tensors (every class must pass the same). Raises on every rank if a rank
    failed to send or rank 0 to receive, or if a tensor several stages hold differs between its copies
    (:func:`same_replicas`)."""
    key = (coord.key, sig)
    if agreed:
        found = STAGED.get(key)
        assert found is not None
        head = coord.broadcast_from_zero(head, None, "save (planning)")
        if not _same_copies(coord, meta, found[1], found[2], None):
            return None
        _compare_shared(coord, flat, found[1], found[2], found[3])
        return found[1], found[2], found[0], head
    sigs = coord.gather_int_to_zero(sig, "save (planning): the ranks' descriptions")
    numbered = None
    if sigs is not None:                    # (rank 0: the classes, sent to every rank run-length encoded)
        class_of, firsts = classes_of(sigs)
        if len(firsts) <= MAX_CLASSES:
            numbered = (*runs(class_of), firsts, digest62(np.asarray(sigs, dtype=np.int64).tobytes()))
    numbered = coord.broadcast_from_zero(numbered, None, "save (planning): the classes of ranks")
    if numbered is None:                    # (so many classes: every rank plans gathered)
        return None
    starts, numbers, firsts, whole = numbered
    class_of = from_runs(starts, numbers, coord.world)
    merged: Staged | str | None = None
    error: BaseException | None = None
    try:
        mine = (meta.tensors, layouts, meta.containers, options, tuple((v.key, v.path) for v in meta.values),
                tuple(t.key for t in flat.tensors if t.implied))
        descs = coord.gather_some(tuple(firsts), mine if coord.rank in firsts else None, DESCRIBE_TAGS,
                                  "save (planning): the stages' descriptions", limit=1 << 28)
        if descs is not None:
            merged = merge_stages([descs[r] for r in firsts], class_of)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the broadcast that follows
        error = e
    head, merged = coord.broadcast_from_zero((head, merged), error, "save (planning)")
    if error is not None:           # (a send that failed: rank 0's receive failed too, or timed out)
        raise error
    if not isinstance(merged, Staged):
        return None
    scoped = stage_layouts(merged, class_of)
    mine = {t.key for t in meta.tensors}
    problem = next((f"key {t.key!r}: the stages' plan gives rank {coord.rank} a tensor it "
                    f"{'lacks' if t.key not in mine else 'holds but is not planned to write'}"
                    for t, la in zip(merged.tensors, scoped) if holds(la, coord.rank) != (t.key in mine)), None)
    # (the tensors several classes hold as replicas of a DTensor's sub-mesh: pipeline stages naming layers alike)
    shared = tuple(i for i, (t, cs) in enumerate(zip(merged.tensors, merged.classes))
                   if len(cs) > 1 and t.key in merged.implied)
    if problem is None:         # (each rank holds exactly its own tensors, in their scope: kept for the next save)
        STAGED.put(key, (whole, merged.tensors, scoped, shared))
    if not _same_copies(coord, meta, merged.tensors, scoped, problem):
        return None
    _compare_shared(coord, flat, merged.tensors, scoped, shared)
    return merged.tensors, scoped, whole, head


def _compare_shared(coord: Coordinator, flat: FlatState, tensors: tuple[TensorMeta, ...],
                    layouts: tuple[Layout, ...], shared: tuple[int, ...]) -> None:
    """``core.replicas.same_replicas`` of the tensors at ``shared`` (the same positions on every rank), each
    rank's box held by the ranks its scoped layout gives."""
    def holders_of(key: str) -> tuple[int, ...] | None:
        la = layouts[pos[key]]
        return layout_holders(la, coord.rank) if holds(la, coord.rank) else None
    pos = {tensors[i].key: i for i in shared}
    same_replicas(coord, flat, [tensors[i].key for i in shared], holders_of)


#: what a rank that does not hold a compared plain tensor votes for it (below every holder's digest and negation)
_ABSENT = -(1 << 62)


def _same_copies(coord: Coordinator, meta: RankMeta, tensors: tuple[TensorMeta, ...], layouts: tuple[Layout, ...],
                 problem: str | None) -> bool:
    """(Collective) whether every plain tensor compared across ranks (``RankMeta.digests``: a model's and an
    optimizer's) holds the same bytes on every rank holding it: one all-reduce of two numbers per tensor of the
    job held whole (each rank's digest and its negation, or :data:`_ABSENT`, by the tensor's place in
    ``tensors``). Copies that differ are stored per rank, which the gathered plan does. A ``problem`` this rank
    found with the plan rides on the same all-reduce: every rank raises (InvalidStateError), none waits."""
    mine = dict(meta.digests)
    votes = [int(problem is not None)]
    for t, la in zip(tensors, layouts):
        if any(d is not None for d in la.shards):
            continue
        d = mine.get(t.key)
        h = int(d, 16) >> 2 if d is not None else None
        votes += [_ABSENT, _ABSENT] if h is None else [h, -h]
    result = coord.all_max(votes, "save (planning): the plain tensors' copies")
    if result[0]:
        raise InvalidStateError(problem or "a rank found the stages' plan gives it tensors it lacks (its error "
                                "names them); nothing was written")
    return all(a == _ABSENT or a == -b for a, b in zip(result[1::2], result[2::2]))
