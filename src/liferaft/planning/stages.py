"""Save planning for ranks that hold different tensors: pipeline stages (issue #20).

Under pipeline parallelism the ranks of each stage hold their own keys (FSDP2 or DDP within a stage, a DTensor on
the stage's sub-mesh), so the ranks do not all describe the same tensors and the one digest of
``planning.layouts`` cannot agree. They still fall into a few classes of ranks that describe alike (one per stage
and position within it, whatever the world): each rank's digest of what it describes is all-gathered (8 bytes a
rank), the first rank of each class sends rank 0 its description, and rank 0 merges them (:func:`merge_stages`)
into one list of every tensor, each with its compact layout and the classes holding it, which it broadcasts.
Every rank then scopes each layout to the ranks holding it (:func:`scoped`) and plans its own writes over the
whole list (``planning.layouts.plan_own``), as when every rank holds every tensor:

- a tensor of a sharding layout held by one slice of the mesh (a DTensor on one stage's sub-mesh, described over
  the root mesh, replicated along the dimensions its sub-mesh lacks): ``Layout.at`` fixes its coordinate along
  those dimensions, recorded in the index (format version 5), so a reader finds its tables as for any layout;
- a tensor held whole by some ranks (a stage's plain tensors, the optimizer's step counts): ``Layout.group``
  lists them; its chunks are listed in the index, as for a tensor every rank holds whole.

Anything else (a key that two classes describe differently, containers that conflict, ranks that hold a tensor
in no slice, more than :data:`MAX_CLASSES` classes; and, checked by ``core.stages``, a plain tensor compared
across ranks whose copies differ) is refused with the reason, and the save is planned gathered. Pure functions; the exchanges are ``core.phases``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from liferaft.errors import InvalidStateError
from liferaft.format.checks import tree_problem
from liferaft.planning.layouts import Layout
from liferaft.planning.save_plan import RankMeta, TensorMeta, merge_containers

#: the most classes of ranks planned this way; beyond, ranks that describe so differently plan gathered
MAX_CLASSES = 256


def classes_of(sigs: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """Each rank's class (ranks of equal ``sigs``, numbered in the order of their first rank) as an int32 array,
    and each class's first rank."""
    arr = np.asarray(sigs, dtype=np.int64)
    _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
    order = np.argsort(first)
    number = np.empty_like(order)
    number[order] = np.arange(len(order))
    return number[inverse.reshape(-1)].astype(np.int32), [int(r) for r in first[order]]


@dataclass(frozen=True)
class Staged:
    """Every tensor of a save from ranks that hold different tensors, in index order (the first class's, then
    each later class's new ones), each with its layout as described (over the world, not scoped) and the
    classes holding it."""

    tensors: tuple[TensorMeta, ...]
    layouts: tuple[Layout, ...]
    classes: tuple[tuple[int, ...], ...]
    #: the keys some class holds as a DTensor on a sub-mesh (replicas by that sub-mesh alone: compared)
    implied: frozenset[str] = frozenset()


def merge_stages(descs: Sequence[Any], class_of: np.ndarray) -> Staged | str:
    """(On rank 0) the merged description of the classes' ``descs`` (class ``c``'s: ``(tensors, layouts,
    containers, options[, values, implied])`` of its first rank: its ``TensorMeta``, their layouts, its
    containers, the options the plan depends on, its values' ``(key, path)`` and the keys of its DTensors on a
    sub-mesh), or why the save must be planned gathered (where
    a conflict is refused, before anything is written: keys or paths used twice across the stages among them)."""
    world = len(class_of)
    index: dict[str, int] = {}
    tensors: list[TensorMeta] = []
    layouts: list[Layout] = []
    classes: list[list[int]] = []
    options = None
    for c, desc in enumerate(descs):
        metas, lays, _, opts, *_ = desc
        if options is None:
            options = opts
        elif opts != options:
            return f"ranks {_first(class_of, 0)} and {_first(class_of, c)} passed different save options"
        if len(metas) != len(lays):
            return f"rank {_first(class_of, c)} described {len(metas)} tensors with {len(lays)} layouts"
        for t, la in zip(metas, lays):
            if not isinstance(la, Layout) or not la.regular or la.world != world or la.at or la.group:
                return f"key {t.key!r}: a layout no stage planning describes ({la})"
            t = replace(t, boxes=())
            i = index.get(t.key)
            if i is None:
                index[t.key] = len(tensors)
                tensors.append(t)
                layouts.append(la)
                classes.append([c])
            elif (tensors[i], layouts[i]) != (t, la):
                return (f"key {t.key!r}: ranks {_first(class_of, classes[i][0])} and {_first(class_of, c)} describe "
                        "it differently")
            else:
                classes[i].append(c)
    try:
        containers = merge_containers([RankMeta(rank=_first(class_of, c), tensors=(), values=(), containers=d[2])
                                       for c, d in enumerate(descs)])
    except InvalidStateError as e:
        return str(e)
    values = {k: _Leaf(k, p) for d in descs for k, p in (d[4] if len(d) > 4 else ())}
    problem = tree_problem(tensors, values.values(), containers)    # (a tensor on one stage, a value on another)
    if problem:
        return problem
    staged = Staged(tuple(tensors), tuple(layouts), tuple(tuple(c) for c in classes),
                    frozenset(k for d in descs for k in (d[5] if len(d) > 5 else ())))
    members = _members(staged, class_of)
    first = {(la, cs): t for t, la, cs in zip(staged.tensors, staged.layouts, staged.classes)}
    for (la, cs), t in first.items():           # (each pair of a layout and its classes once)
        if scoped(la, members[cs]) is None:
            return (f"key {t.key!r}: the ranks holding it ({len(members[cs])} of {world}) are no slice of its "
                    f"layout {la.mesh}")
    return staged


def runs(class_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``class_of`` run-length encoded: where each run of one class starts, and its class (what rank 0 sends every
    rank: a run per stage, when each stage's ranks are consecutive)."""
    if not len(class_of):
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    starts = np.flatnonzero(np.r_[True, class_of[1:] != class_of[:-1]])
    return starts.astype(np.int64), class_of[starts].astype(np.int32)


def from_runs(starts: np.ndarray, classes: np.ndarray, world: int) -> np.ndarray:
    """:func:`runs`' inverse, for ``world`` ranks."""
    return np.repeat(classes, np.diff(np.r_[starts, world])).astype(np.int32)


class _Leaf(NamedTuple):
    key: str
    path: tuple[Any, ...]


def _first(class_of: np.ndarray, c: int) -> int:
    return int(np.flatnonzero(class_of == c)[0])


def _members(staged: Staged, class_of: np.ndarray) -> dict[tuple[int, ...], np.ndarray]:
    """The ranks of each set of classes holding some tensor of ``staged``."""
    return {cs: np.flatnonzero(np.isin(class_of, cs)) for cs in set(staged.classes)}


def scoped(layout: Layout, members: np.ndarray) -> Layout | None:
    """``layout`` (over ``world`` ranks) scoped to the ranks ``members`` (sorted) that hold its tensor: unchanged
    when every rank does; else, for a tensor held whole, with ``group``; else with ``at`` when they are exactly
    the ranks at one coordinate along some replicating mesh dimensions; else None. Also None for a
    sharding layout whose every box is held by every rank (a mesh dimension of one rank shards it): its group
    would be the whole world, which a reader's replay could not tell apart from the tensors held whole."""
    world = layout.world
    sharding = any(d is not None for d in layout.shards)
    if sharding and math.prod(n for n, d in zip(layout.mesh, layout.shards) if d is None) == world:
        return None
    if len(members) == world:
        return layout
    if not len(members):
        return None
    if not sharding:            # (held whole: its chunks are listed in the index, which needs no scope)
        return replace(layout, group=tuple(int(r) for r in members))
    coords = np.unravel_index(members, layout.mesh)
    at: list[int | None] = [int(x[0]) if d is None and n > 1 and bool((x == x[0]).all()) else None
                            for x, n, d in zip(coords, layout.mesh, layout.shards)]
    if any(a is not None for a in at) and \
            math.prod(n for n, a in zip(layout.mesh, at) if a is None) == len(members):
        return replace(layout, at=tuple(at))
    return None


def stage_layouts(staged: Staged, class_of: np.ndarray) -> tuple[Layout, ...]:
    """Every tensor's layout scoped to the ranks holding it (:func:`scoped`; ``merge_stages`` checked that each
    has one), the same on every rank."""
    members = _members(staged, class_of)
    done: dict[tuple[Layout, tuple[int, ...]], Layout] = {}
    out = []
    for la, cs in zip(staged.layouts, staged.classes):
        found = done.get((la, cs))
        if found is None:
            found = scoped(la, members[cs])
            if found is None:
                raise ValueError(f"stage_layouts: {la} has no scope for classes {cs}")
            done[(la, cs)] = found
        out.append(found)
    return tuple(out)
