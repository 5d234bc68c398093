"""What a load does not count as a mismatch between the state and a checkpoint — one set of rules for every load
path (liferaft checkpoints in ``api.load``, safetensors and DCP sources in ``tools.sources``).

1. **Optimizer state of a parameter the optimizer never stepped.** A load template (``flatten(template=True)``)
   marks as *optional* the subtrees that hold only placeholders (``OptimizerAdapter``: a fresh optimizer gets
   placeholder state for every parameter; a parameter the loss never touched has no state in the saving run).
   A checkpoint that lacks every key of such a subtree is consistent with it: those keys are not missing, and
   the subtree is removed from the state dict before ``load_state_dict``, so the optimizer ends without state
   for that parameter, exactly as saved. A checkpoint that holds some of the subtree's keys but not all
   (``exp_avg`` without ``exp_avg_sq``) is still a mismatch. Where the checkpoint stores the emptied container
   itself as a value (``optim.state = {}``: saved before the optimizer's first step), that value is matched by it.
   The rule holds only where the checkpoint's optimizer is of the live one's kind: the class the checkpoint
   records for it (``ContainerEntry.cls``) is the live optimizer's, or — a checkpoint or source that records
   none — it holds, for some parameter, every state key the live optimizer gives the subtree, or no state at
   all. An SGD checkpoint loaded into AdamW therefore still misses ``exp_avg``; and a load whose checkpoint
   ``param_groups`` have other keys than the live optimizer's (``momentum`` where AdamW needs ``betas``) is
   a mismatch too (:func:`param_groups_mismatch`; ``api.load`` refuses it when strict and otherwise keeps the
   live ``param_groups``), and so is one whose groups hold the parameters (their names) otherwise grouped than
   the live optimizer's (:func:`param_groups_regrouped`: one group's hyperparameters would silently reach
   another group's parameters, or a new group be left without any): refused when strict; otherwise each live
   group whose parameters a saved group holds exactly (those of it in the checkpoint) takes that group's
   hyperparameters, and the others keep their own.
2. **Buffers a module does not persist.** A checkpoint key naming a buffer registered with ``persistent=False``
   (by its state-dict name, wrapper prefixes removed; e.g. ``embeddings.position_ids`` in Hugging Face's BERT
   files, which ``from_pretrained`` ignores too) is not unexpected: it is skipped, not loaded, and listed in
   ``LoadResult.skipped_keys``.

PyTorch DCP (``set_optimizer_state_dict`` / ``set_model_state_dict`` strict) treats both as errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from liferaft.format.manifest import PathPart
from liferaft.state.flatten import FlatState, key_of
from liferaft.state.values import PerRank


def _under(path: tuple[PathPart, ...], prefix: tuple[PathPart, ...]) -> bool:
    return path[:len(prefix)] == prefix


def _leaf_paths(flat: FlatState) -> list[tuple[str, tuple[PathPart, ...]]]:
    return [(t.key, t.path) for t in flat.tensors] + [(k, p) for k, p, _ in flat.values]


def _owner(flat: FlatState, sub: tuple[PathPart, ...]) -> tuple[PathPart, ...] | None:
    """The path of the stateful object whose (optional) subtree ``sub`` is."""
    owners = [p for p, _, _ in flat.statefuls if len(p) < len(sub) and _under(sub, p)]
    return max(owners, key=len) if owners else None


def _same_kind(flat: FlatState, sub: tuple[PathPart, ...], keys: list[str],
               saved_classes: Mapping[tuple[PathPart, ...], str | None] | None, saved: Collection[str] | None) -> bool:
    """Whether the checkpoint's object owning ``sub`` is of the live one's kind (see the module doc, rule 1)."""
    owner = _owner(flat, sub)
    if owner is None:
        return True
    saved_cls = (saved_classes or {}).get(owner)
    if saved_cls is not None:
        live_cls = next((c.cls for c in flat.containers if c.path == owner), None)
        return live_cls is None or live_cls == saved_cls
    if saved is None:
        return True
    # no class recorded: some parameter's saved state holds every state key the live optimizer has here
    base = key_of(sub)
    rel = [k[len(base) + 1:] for k in keys]
    state = key_of(sub[:-1]) + "."
    held = [k for k in saved if k.startswith(state)]
    if not held:
        return True                         # the checkpoint holds no optimizer state at all (never stepped)
    have = set(held)
    first = "." + rel[0]
    return any(all(k[:-len(first)] + "." + r in have for r in rel) for k in held if k.endswith(first))


def settle_missing(flat: FlatState, missing: Iterable[str],
                   saved_classes: Mapping[tuple[PathPart, ...], str | None] | None = None,
                   saved: Collection[str] | None = None) -> tuple[list[str], list[tuple[PathPart, ...]]]:
    """Rule 1 on this rank's ``missing`` keys: the keys still missing, and the optional subtrees the checkpoint
    lacks as a whole (to remove with :func:`drop_absent` before the stateful objects load). ``saved_classes``:
    the classes the checkpoint records for its stateful objects (by path); ``saved``: all its keys."""
    missing = list(missing)
    if not flat.optional:
        return missing, []
    gone = set(missing)
    leaves = _leaf_paths(flat)
    absent: list[tuple[PathPart, ...]] = []
    for sub in flat.optional:
        keys = [k for k, p in leaves if _under(p, sub)]
        if keys and all(k in gone for k in keys) and _same_kind(flat, sub, keys, saved_classes, saved):
            absent.append(sub)
            gone.difference_update(keys)
    return [k for k in missing if k in gone], absent


#: Keys torch's LR schedulers add to an optimizer's param groups (``initial_lr`` every one of them; OneCycleLR the
#: others, CyclicLR the momentum ones, SWALR ``swa_lr``). Saved groups that have some the live ones lack (a run with
#: a scheduler loaded for fine-tuning or evaluation without it) are no mismatch: torch loads them, nothing reads
#: them. Live groups that have some the saved lack are: the live scheduler would read a key the load removes.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})


def _group_keys(groups: Any) -> set[str] | None:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return None
    return {str(k) for g in groups for k in g}


def _live_groups(flat: FlatState, path: tuple[PathPart, ...]) -> Any:
    """The live ``param_groups`` where ``path`` is an optimizer's ``param_groups`` in the state, else None."""
    if not path or path[-1] != "param_groups":
        return None
    if not any(c.path == path[:-1] and c.role == "optimizer" for c in flat.containers):
        return None
    node = flat.nodes.get(path[:-1])
    return node.get("param_groups") if isinstance(node, dict) else None


def param_groups_mismatch(flat: FlatState, path: tuple[PathPart, ...], saved_groups: Any) -> str | None:
    """Where ``path`` is the ``param_groups`` of an optimizer in the state: a description of how the key set of
    the checkpoint's ``saved_groups`` differs from the live optimizer's (None: same keys, only saved keys an LR
    scheduler adds (``SCHEDULER_KEYS``), or not an optimizer's)."""
    live = _group_keys(_live_groups(flat, path))
    saved = _group_keys(saved_groups)
    if live is None or saved is None or live == saved or (not live - saved and saved - live <= SCHEDULER_KEYS):
        return None
    parts = []
    if live - saved:
        parts.append(f"the checkpoint's lack {sorted(live - saved)}")
    if saved - live:
        parts.append(f"only the checkpoint's have {sorted(saved - live)}")
    why = "it was saved by another kind of optimizer"
    if (live ^ saved) & SCHEDULER_KEYS:
        why += (f", or beside another LR scheduler than the live one ({', '.join(sorted((live ^ saved) & SCHEDULER_KEYS))}"
                ": keys a scheduler adds to the groups; create the scheduler as the run that saved did, or load "
                "non-strict)")
    return (f"key {key_of(path)!r}: the param_groups of the checkpoint and of the live optimizer have different "
            f"keys ({'; '.join(parts)}): {why}")


def _param_id(p: Any) -> bool:
    """A parameter's name in a param group: its name (``get_optimizer_state_dict``) or, for an optimizer no one
    module owns (``MethodAdapter``) and torch's own ``state_dict()``, its index."""
    return isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))


def _order(names: set[Any]) -> list[Any]:
    """``names`` sorted (names and indices alike: a checkpoint may hold either)."""
    return sorted(names, key=lambda p: (isinstance(p, str), p))


def param_groups_malformed(flat: FlatState, path: tuple[PathPart, ...], saved_groups: Any) -> str | None:
    """Where ``path`` is an optimizer's ``param_groups``: what makes the checkpoint's ``saved_groups`` no list of
    param groups (each a dict with string keys and a ``params`` list of parameter names or indices, as every
    optimizer state dict holds), which torch's loaders would fail on or, worse, half apply; None when well formed
    or not an optimizer's."""
    if _live_groups(flat, path) is None:
        return None
    what = f"key {key_of(path)!r}"
    if not isinstance(saved_groups, (list, tuple)):
        return f"{what}: the checkpoint's param_groups are a {type(saved_groups).__name__}, not a list of groups"
    for i, g in enumerate(saved_groups):
        if not isinstance(g, dict) or not all(isinstance(k, str) for k in g):
            return f"{what}: param group {i} of the checkpoint is a {type(g).__name__}, not a dict of hyperparameters"
        params = g.get("params")
        if not isinstance(params, (list, tuple)) or not all(_param_id(p) for p in params):
            return f"{what}: param group {i} of the checkpoint has no list of parameter names or indices ('params')"
    return None


def _partition(groups: Any) -> list[tuple[set[str], dict[str, Any]]] | None:
    """[(a group's parameter names, the group)], or None for what is no list of groups with name lists."""
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return None
    out = []
    for g in groups:
        params = g.get("params")
        if not isinstance(params, (list, tuple)) or not all(_param_id(p) for p in params):
            return None
        out.append((set(params), g))
    return out


def param_groups_regrouped(flat: FlatState, path: tuple[PathPart, ...], saved_groups: Any) -> tuple[str, Any] | None:
    """Where ``path`` is an optimizer's ``param_groups`` and the checkpoint's ``saved_groups`` group the
    parameters both hold otherwise than the live optimizer (a live group's parameters spread over several saved
    groups or none, or a saved group's over several live groups): (what differs, the param_groups to load when
    not strict: per live group, the saved group holding exactly its parameters — its hyperparameters, the live
    group's parameter names — else the live group as it is). None: grouped alike (in any order)."""
    live = _partition(_live_groups(flat, path))
    saved = _partition(saved_groups)
    if live is None or saved is None:
        return None
    every = set().union(*(p for p, _ in live))
    common = every & set().union(*(p for p, _ in saved))
    live_sets = [p & common for p, _ in live]
    saved_sets = [p & common for p, _ in saved]
    # (a live group none of whose parameters a saved group holds: torch's loader leaves it without hyperparameters
    # — no lr, no betas — and the next step fails; a group of saved and new parameters takes its saved group's)
    left_out = [i for i, (s, (p, _)) in enumerate(zip(live_sets, live, strict=True)) if p and not s]
    if not left_out and Counter(map(frozenset, live_sets)) == Counter(map(frozenset, saved_sets)):
        return None
    merged, odd = [], []
    for i, ((params, group), mine) in enumerate(zip(live, live_sets, strict=True)):
        match = next((g for (_, g), theirs in zip(saved, saved_sets, strict=True) if mine and theirs == mine), None)
        if match is None:
            merged.append(dict(group))
            odd.append(i)
        else:
            merged.append({**{k: v for k, v in match.items() if k != "params"}, "params": list(group["params"])})
    if left_out:
        lost = sorted(map(str, live[left_out[0]][0]))
        return (f"key {key_of(path)!r}: no param group of the checkpoint's holds any parameter of live group "
                f"{left_out[0]} ({lost[:4]}{' ...' if len(lost) > 4 else ''}): it would be left without "
                "hyperparameters (lr, betas, ...)"), merged
    shown = "; ".join(f"live group {i}: {_order(live_sets[i])[:4]}" for i in odd[:3]) or \
        f"the checkpoint's groups {[_order(s)[:4] for s in saved_sets][:3]}"
    return (f"key {key_of(path)!r}: the checkpoint's param_groups group the parameters otherwise than the live "
            f"optimizer's (no saved group holds exactly the parameters of {shown}): its hyperparameters (lr, "
            "weight decay, ...) would reach other parameters than they were saved for"), merged


def matches_emptied(flat: FlatState, absent: Collection[tuple[PathPart, ...]], path: tuple[PathPart, ...],
                    value: Any) -> bool:
    """Rule 1, last sentence: whether a checkpoint value at ``path`` that no leaf of the state takes is the empty
    container the state's container there becomes once the ``absent`` subtrees are removed."""
    if path not in flat.nodes or not absent or not isinstance(value, (dict, list, tuple)) or len(value):
        return False
    inside = [p for _, p in _leaf_paths(flat) if _under(p, path)]
    return bool(inside) and all(any(_under(p, sub) for sub in absent) for p in inside)


def drop_absent(flat: FlatState, absent: Iterable[tuple[PathPart, ...]]) -> None:
    """Remove the ``absent`` subtrees from their containers in the state dicts about to be loaded."""
    for sub in absent:
        parent = flat.nodes.get(sub[:-1])
        if isinstance(parent, dict):
            parent.pop(sub[-1], None)


def not_persisted(flat: FlatState, saved: Iterable[str]) -> list[str]:
    """Rule 2: those of the checkpoint's keys ``saved`` that name a buffer a module of this rank's state does not
    persist (and that no leaf of the state takes)."""
    if not flat.not_persisted:
        return []
    wanted = {k for k, _ in _leaf_paths(flat)}
    return sorted(k for k in saved if k in flat.not_persisted and k not in wanted)


def value_within(has: Callable[[str], bool], get: Callable[[str], Any],
                 path: tuple[PathPart, ...]) -> tuple[str, int, Any] | None:
    """Where the state's plain value at ``path`` has no key of its own in a checkpoint but lies inside a plain dict
    the checkpoint holds at an ancestor of it (``has``: a saved value key the load may use): (that key, the
    ancestor's length, the value found), else None (pure but for ``get``, which decodes a saved value). A liferaft
    save keeps a container of plain values whole (one key), and a stateful object's entries as keys of their own: a
    scheduler that a foreign format stored as a plain dict (``torch.save``, DCP, converted by ``liferaft
    convert``) is found here entry by entry. Only dicts are walked, by keys of the same type as the path's parts (a
    saved list is no object's entries; a value saved per rank, ``PerRank``, is never looked into: its rows are the
    ranks', not entries)."""
    for i in range(len(path) - 1, 0, -1):
        key = key_of(path[:i])
        if not has(key):
            continue
        value = get(key)
        for part in path[i:]:
            if isinstance(value, PerRank) or not isinstance(value, dict) or \
                    not any(k == part and type(k) is type(part) for k in value):
                return None
            value = value[part]
        return None if isinstance(value, PerRank) else (key, i, value)
    return None


def leaves_of(value: Any, at: tuple[PathPart, ...] = ()) -> Iterator[tuple[PathPart, ...]]:
    """The paths of the leaves of a plain value, dicts walked (pure; an empty dict, and any other value, is a
    leaf)."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaves_of(v, at + (k,))
    else:
        yield at


def covers(value: Any, taken: Collection[tuple[PathPart, ...]]) -> bool:
    """Whether the paths ``taken`` out of the plain ``value`` (``value_within``) cover every leaf of it (pure)."""
    return all(any(leaf[:len(t)] == t for t in taken) for leaf in leaves_of(value))

