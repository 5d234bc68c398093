"""Nested containers rebuilt from leaves keyed by path: what ``read`` returns and what the readers of formats
that record a nesting (liferaft's containers, DCP's ``planner_data``) give back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from liferaft.errors import CorruptCheckpointError

PathPart = str | int


def build_tree(kinds: Mapping[tuple[PathPart, ...], str], leaves: Mapping[tuple[PathPart, ...], Any],
               orders: Mapping[tuple[PathPart, ...], Sequence[PathPart]] | None = None) -> Any:
    """Nested dict/list/tuple from container kinds and leaf values keyed by path, children in saved order. Built
    deepest level first, without recursion. Its cost grows with the square of a path's length (every prefix is a
    node): the readers refuse paths of more than ``MAX_NESTING`` parts before they get here. A node on the way to a
    leaf or container that has no kind of its own is a dict (nothing below it is dropped)."""
    children: dict[tuple[PathPart, ...], list[PathPart]] = {p: [] for p in kinds}
    seen: set[tuple[PathPart, ...]] = set()
    for p in list(kinds) + list(leaves):
        for i in range(len(p), 0, -1):             # every node on the way, not only the parent
            if p[:i] in seen:
                break
            seen.add(p[:i])
            children.setdefault(p[:i - 1], []).append(p[i - 1])
    for p in leaves:
        if p in children:                           # (a foreign checkpoint's keys: "x" and "x.sub")
            what = f"{children[p][0]!r:.100} lies under it" if children[p] else "it is a container too"
            raise CorruptCheckpointError(f"the entry at path {list(p)!r:.200} is a value, yet {what}; the "
                                         "checkpoint's keys do not form a tree (read it with keys= naming the ones "
                                         "wanted)")
    for p, order in (orders or {}).items():
        if p in children:
            present = set(children[p])
            rank = {k: i for i, k in enumerate(order)}
            children[p] = sorted(present, key=lambda k: (rank.get(k, len(rank)), str(k)))

    built: dict[tuple[PathPart, ...], Any] = {}
    for p in sorted(children.keys() - leaves.keys(), key=len, reverse=True):   # deepest first: no recursion
        kind = kinds.get(p, "dict")
        parts = children[p]
        if kind in ("list", "tuple"):
            items = [_got(p + (k,), leaves, built) for k in sorted(parts, key=lambda x: int(x))]
            built[p] = items if kind == "list" else tuple(items)
        else:
            built[p] = {k: _got(p + (k,), leaves, built) for k in parts}
    return _got((), leaves, built)


def _got(p: tuple[PathPart, ...], leaves: Mapping[tuple[PathPart, ...], Any], built: dict) -> Any:
    return leaves[p] if p in leaves else built.get(p, {})


def nest(leaves: dict[tuple[Any, ...], Any]) -> Any:
    """Nested containers from leaves keyed by path: lists where every child is an int index, else dicts."""
    children: dict[tuple[Any, ...], list[Any]] = {}
    for p in leaves:
        for i in range(len(p)):
            children.setdefault(p[:i], []).append(p[i])
    kinds = {p: "list" if all(isinstance(k, int) for k in ks) and sorted(set(ks)) == list(range(len(set(ks))))
             else "dict" for p, ks in children.items()}
    return build_tree(kinds, leaves)


