"""Structural checks of a decoded manifest that span entries: the saved tree (paths, container kinds and their
children) and the nesting of plain values. ``format.manifest.decode_manifest`` runs them, so that nothing later
(``state.tree.build_tree``, ``state.values.decode_value``, the tools) meets a tree it cannot rebuild or a value
nested deeper than ``limits.MAX_NESTING``. Each returns a description of the first problem, or None.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from liferaft.format.limits import MAX_NESTING

PathPart = str | int
#: tags whose body holds nested values (one level each); every other ``$`` tag is a leaf (bytes, arrays, ...)
_NESTING_TAGS = ("$tuple", "$set", "$frozenset", "$dict")


def value_depth(encoded: Any, limit: int = MAX_NESTING) -> int:
    """The container levels of the plain value ``encoded`` (tagged JSON of ``state.values``) decodes to: 0 for a
    scalar, 1 for a flat list, ...; stops counting (returns ``limit + 1``) once past ``limit``. Iterative."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(encoded, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, list):
            children: Iterable[Any] = v
        elif isinstance(v, dict):
            if len(v) == 1:
                (tag, body), = v.items()
                if tag.startswith("$"):
                    if tag not in _NESTING_TAGS or not isinstance(body, list):
                        continue                    # a leaf tag (its shape is checked when decoded)
                    children = (x for pair in body for x in (pair if tag == "$dict" and isinstance(pair, list)
                                                            else (pair,)))
                else:
                    children = v.values()
            else:
                children = v.values()
        else:
            continue
        depth += 1
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((c, depth) for c in children)
    return deepest


def tree_problem(tensors: Iterable[Any], values: Iterable[Any], containers: Iterable[Any]) -> str | None:
    """The problem with the saved tree of a manifest's ``tensors``, ``values`` and ``containers`` (anything with
    ``key`` and ``path``; containers with ``path``, ``kind``, ``children``), or None: a key used twice (a tensor
    and a value, two of either), else :func:`check_tree`'s. What a reader refuses, so what a save checks before
    it commits (ranks whose states conflict: a key that is a tensor on one pipeline stage, a value or a
    container on another)."""
    tensors, values = list(tensors), list(values)
    seen: set[str] = set()
    dup: set[str] = set()
    for x in [*tensors, *values]:
        (dup if x.key in seen else seen).add(x.key)
    if dup:
        return f"keys {sorted(dup)[:5]} appear more than once"
    return check_tree([(x.key, x.path) for x in [*tensors, *values]],
                      [(c.path, c.kind, c.children) for c in containers])


def check_tree(leaves: Iterable[tuple[str, Sequence[PathPart]]],
               containers: Iterable[tuple[Sequence[PathPart], str, Sequence[PathPart] | None]]) -> str | None:
    """The problem with a saved tree, or None. ``leaves``: (key, path) of every tensor and value; ``containers``:
    (path, kind, listed children or None). The tree holds when: paths have at most ``MAX_NESTING`` parts; no
    path is used twice (by two leaves, two containers, or a leaf and a container); every key is its path joined
    by ``.``; nothing lies under a leaf;
    a list / tuple container's children are exactly the indices 0..n-1; listed children are distinct and name
    what lies under the container (some may be missing: a load with ``keys=`` saved a part)."""
    kinds: dict[tuple[PathPart, ...], str] = {}
    listed: dict[tuple[PathPart, ...], Sequence[PathPart]] = {}
    leaf_paths: dict[tuple[PathPart, ...], str] = {}
    for path, kind, children in containers:
        p = tuple(path)
        if len(p) > MAX_NESTING:
            return f"a container's path has {len(p)} parts, more than {MAX_NESTING}"
        if p in kinds:
            return f"container {list(p)!r:.200} is recorded twice"
        kinds[p] = kind
        if children is not None:
            if len(set(children)) != len(children):
                return f"container {list(p)!r:.200} lists a child twice"
            listed[p] = children
    for key, path in leaves:
        p = tuple(path)
        if len(p) > MAX_NESTING:
            return f"key {key!r:.200}: its path has {len(p)} parts, more than {MAX_NESTING}"
        if key != ".".join(map(str, p)):                # FORMAT.md §7: a key is its path's parts joined by "."
            return f"key {key!r:.200} is not its path {list(p)!r:.200} joined by '.'"
        if p in leaf_paths or p in kinds:
            return f"key {key!r:.200}: its path {list(p)!r:.200} is used twice"
        leaf_paths[p] = key
    under: dict[tuple[PathPart, ...], set[PathPart]] = {}
    for p in list(kinds) + list(leaf_paths):
        if p:
            under.setdefault(p[:-1], set()).add(p[-1])
    for parent, parts in under.items():
        if parent in leaf_paths:
            return f"key {leaf_paths[parent]!r:.200} is a leaf, yet entries lie under it"
        kind = kinds.get(parent, "dict")
        if kind in ("list", "tuple") and not _indices(parts, len(parts)):
            return (f"{kind} container {list(parent)!r:.200} has children {sorted(map(str, parts))[:8]!r:.200}, "
                    "not the indices 0..n-1")
    for p, children in listed.items():
        if kinds[p] in ("list", "tuple") and not _indices(set(children), len(children)):
            return f"{kinds[p]} container {list(p)!r:.200} lists children that are not the indices 0..n-1"
        extra = under.get(p, set()) - set(children)
        if extra:
            return f"container {list(p)!r:.200} holds {sorted(map(str, extra))[:5]!r:.200}, which it does not list"
    return None


def _indices(parts: Iterable[PathPart] | Mapping[PathPart, Any], n: int) -> bool:
    """Whether ``parts`` are exactly the ints 0..n-1 (no bools, no strings)."""
    s = set(parts)
    return len(s) == n and all(type(k) is int and 0 <= k < n for k in s)
