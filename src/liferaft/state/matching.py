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
2. **Buffers a module does not persist.** A checkpoint key naming a buffer registered with ``persistent=False``
   (by its state-dict name, wrapper prefixes removed; e.g. ``embeddings.position_ids`` in Hugging Face's BERT
   files, which ``from_pretrained`` ignores too) is not unexpected: it is skipped, not loaded, and listed in
   ``LoadResult.skipped_keys``.

PyTorch DCP (``set_optimizer_state_dict`` / ``set_model_state_dict`` strict) treats both as errors.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

from liferaft.format.manifest import PathPart
from liferaft.state.flatten import FlatState


def _under(path: tuple[PathPart, ...], prefix: tuple[PathPart, ...]) -> bool:
    return path[:len(prefix)] == prefix


def _leaf_paths(flat: FlatState) -> list[tuple[str, tuple[PathPart, ...]]]:
    return [(t.key, t.path) for t in flat.tensors] + [(k, p) for k, p, _ in flat.values]


def settle_missing(flat: FlatState, missing: Iterable[str]) -> tuple[list[str], list[tuple[PathPart, ...]]]:
    """Rule 1 on this rank's ``missing`` keys: the keys still missing, and the optional subtrees the checkpoint
    lacks as a whole (to remove with :func:`drop_absent` before the stateful objects load)."""
    missing = list(missing)
    if not flat.optional:
        return missing, []
    gone = set(missing)
    leaves = _leaf_paths(flat)
    absent: list[tuple[PathPart, ...]] = []
    for sub in flat.optional:
        keys = [k for k, p in leaves if _under(p, sub)]
        if keys and all(k in gone for k in keys):
            absent.append(sub)
            gone.difference_update(keys)
    return [k for k in missing if k in gone], absent


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
