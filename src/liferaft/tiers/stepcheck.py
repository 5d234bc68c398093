"""A step record checked against the live state before any replay (docs/STEPLOG.md, "Recovery").

The checksums of a record (``tiers.steprecord``) say its bytes are the bytes written; they do not say the record
fits the state it is about to be replayed into. ``check_record`` checks everything a replay and the load of the
record's rest of the state will use, with nothing changed yet: every call names a live optimizer, lists one
gradient (or none) per parameter with the parameter's local shape and dtype, one set of hyperparameters per param
group with keys the group has and values of the kinds it holds, keyword arguments ``step`` accepts, GradScaler's
attributes as torch sets them; and the rest of the state has every key of the live state a replay does not
rebuild, with the live shapes and dtypes, and values that decode. Anything else raises CorruptCheckpointError
naming the file: the recovery treats the record as damaged and stops at the step before it.

Also a recovery's check of its own records and their replay (``check_own``, ``replay_record``), and whose a log
is: ``owner_id`` (the namespace folder and the ``owner`` every record names) and ``lock_writer`` (one live writer
per namespace and rank).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any

import torch

from liferaft.errors import CheckpointBusyError, CorruptCheckpointError, LiferaftError
from liferaft.state import optsteps
from liferaft.state.dtypes import dtype_name
from liferaft.state.flatten import flatten
from liferaft.state.matching import param_groups_malformed, param_groups_mismatch, param_groups_regrouped
from liferaft.state.values import decode_value
from liferaft.tiers import namespace
from liferaft.tiers.stepplan import verify_record
from liferaft.tiers.steprecord import Header, parse_record, tensor_at, tensor_view


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: step record {what}; it does not fit the live state, so the per-step log "
                                  "stops before it (recovery resumes from the step before it)")


def _entry_kind(entry: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or \
            not isinstance(entry.get("shape"), list):
        raise _bad(path, "has a malformed tensor entry")
    return ("tensor", entry["dtype"], tuple(entry["shape"]))


def _kind(v: Any) -> Any:
    """A value's kind for comparing a recorded hyperparameter with the live one: numbers alike (an int lr is a
    float lr), sequences element by element, tensors by dtype and local shape."""
    if isinstance(v, torch.Tensor):
        local = optsteps.local_of(v)
        return ("tensor", dtype_name(local.dtype), tuple(local.shape))
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return ("seq", tuple(_kind(x) for x in v))
    return type(v).__qualname__


def _odd_setting(v: Any, live: Any) -> str | None:
    """What a recorded hyperparameter ``v`` of the live one's kind (``_kind``) may not be: an integer too large
    for a float (torch converts the numbers: 400 digits raise there), or a setting other than a number — a flag,
    None, a string: ``amsgrad``, ``foreach``, ``capturable``, ``nesterov`` — other than the live group's. Those
    are fixed when the optimizer is made; the live value is the full checkpoint's, and a record that changes one
    since would replay another algorithm, or fail half way through the step (``amsgrad`` without its state).
    None: fine."""
    if isinstance(v, (list, tuple)):
        return next((o for o in map(_odd_setting, v, live) if o is not None), None)
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return None if v == live else f"{str(v)[:40]!r} where the live group holds {str(live)[:40]!r} (a setting " \
            "fixed when the optimizer was made)"
    if isinstance(v, int):
        try:
            float(v)
        except OverflowError:
            return f"{str(v)[:40]}..., an integer too large for a float"
    return None


def _recorded_kind(v: Any, key: str, path: str, allow_pickle: bool) -> Any:
    if isinstance(v, dict) and set(v) == {"$t"}:
        return _entry_kind(v["$t"], path)
    return _kind(decode_value(v, key, allow_pickle))


def _accepts(opt: torch.optim.Optimizer) -> tuple[set[str], bool]:
    """(the keyword names ``opt.step`` takes, whether it takes any)."""
    try:
        params = inspect.signature(opt.step).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _check_call(call: Any, opts: list[torch.optim.Optimizer], path: str, allow_pickle: bool) -> None:
    if not isinstance(call, dict) or not {"opt", "grads", "groups", "kwargs"} <= set(call) or \
            not set(call) <= {"opt", "grads", "groups", "kwargs", "attrs"}:
        raise _bad(path, "has a malformed optimizer call")
    i = call["opt"]
    if type(i) is not int or not 0 <= i < len(opts):
        raise _bad(path, f"names optimizer {str(i)[:20]}; the state has {len(opts)}")
    opt, name = opts[i], type(opts[i]).__qualname__
    params = optsteps.params_of(opt)
    grads, groups, kwargs = call["grads"], call["groups"], call["kwargs"]
    if not isinstance(grads, list) or len(grads) != len(params):
        raise _bad(path, f"lists {len(grads) if isinstance(grads, list) else 'no'} gradients for {name} "
                         f"{i}, which has {len(params)} parameters")
    for j, (entry, p) in enumerate(zip(grads, params, strict=True)):
        if entry is None:
            continue
        want = _kind(p)
        if _entry_kind(entry, path) != want:
            raise _bad(path, f"has a gradient {entry.get('dtype')} {entry.get('shape')} for parameter {j} of {name} "
                             f"{i}, which is {want[1]} {list(want[2])} here")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise _bad(path, f"lists {len(groups) if isinstance(groups, list) else 'no'} param groups for {name} {i}, "
                         f"which has {len(opt.param_groups)}")
    for j, (rec, live) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if not isinstance(rec, dict):
            raise _bad(path, f"has a malformed param group {j} of {name} {i}")
        for k, v in rec.items():
            if k == "params" or k not in live:
                raise _bad(path, f"sets hyperparameter {k[:40]!r} that param group {j} of {name} {i} lacks")
            got, want = _recorded_kind(v, k, path, allow_pickle), _kind(live[k])
            if got != want:
                raise _bad(path, f"sets hyperparameter {k!r} of param group {j} of {name} {i} to a {got}, the "
                                 f"group holds a {want}")
            odd = None if isinstance(got, tuple) and got[0] == "tensor" else \
                _odd_setting(decode_value(v, k, allow_pickle), live[k])
            if odd is not None:
                raise _bad(path, f"sets hyperparameter {k!r} of param group {j} of {name} {i} to {odd}")
    names, anything = _accepts(opt)
    if not isinstance(kwargs, dict):
        raise _bad(path, f"has malformed keyword arguments for {name} {i}")
    for k, v in kwargs.items():
        if k == "closure" or (k not in names and not anything):
            raise _bad(path, f"passes keyword argument {k[:40]!r}, which {name}.step() does not take")
        _recorded_kind(v, k, path, allow_pickle)
    attrs = call.get("attrs", {})
    if not isinstance(attrs, dict):
        raise _bad(path, f"has malformed GradScaler attributes for {name} {i}")
    for k, v in attrs.items():
        if k not in optsteps.AMP_ATTRS:
            raise _bad(path, f"sets attribute {k[:40]!r} on {name} {i} (only {', '.join(optsteps.AMP_ATTRS)})")
        got = _recorded_kind(v, k, path, allow_pickle)
        if got != "NoneType" and not (isinstance(got, tuple) and got[0] == "tensor" and got[1].startswith("float")
                                      and got[2] in ((), (1,))):
            raise _bad(path, f"sets {k} of {name} {i} to a {got}; GradScaler sets a one-element float tensor")


def check_rest(flat: Any, rest: Any, path: str, live: set[int], allow_pickle: bool) -> None:
    """The rest section of a record against ``flat`` (``flatten(state, template=True)``): what ``restore_rest``
    will need, checked with nothing loaded."""
    if not isinstance(rest, dict) or not isinstance(rest.get("tensors"), dict) or \
            not isinstance(rest.get("values"), dict):
        raise _bad(path, "has a malformed rest of the state")
    tensors = rest["tensors"]
    for leaf in flat.tensors:
        entries = tensors.get(leaf.key)
        parts = [t for _, t in leaf.parts]
        if entries is None:
            if all(t.numel() == 0 or t.data_ptr() in live for t in parts):
                continue
            raise _bad(path, f"lacks key {leaf.key!r} of the live state")
        if not isinstance(entries, list) or len(entries) != len(parts):
            raise _bad(path, f"has another number of local parts of key {leaf.key!r} than the live state")
        for e, t in zip(entries, parts, strict=True):
            got, want = _entry_kind(e, path), ("tensor", dtype_name(t.dtype), tuple(t.shape))
            if got != want:
                raise _bad(path, f"has key {leaf.key!r} as {got[1]} {list(got[2])}, the live state as {want[1]} "
                                 f"{list(want[2])}")
    paths = {key: p for key, p, _ in flat.values}
    for key, v in rest["values"].items():
        value = decode_value(v, key, allow_pickle)
        at = paths.get(key)
        problem = None if at is None else param_groups_malformed(flat, at, value) or \
            param_groups_mismatch(flat, at, value) or (param_groups_regrouped(flat, at, value) or (None,))[0]
        if problem is not None:         # (written by this optimizer: its groups are the live ones, by name)
            raise _bad(path, f"has {problem}")


def check_record(header: Any, state: Any, optimizers: list[torch.optim.Optimizer], live: set[int],
                 allow_pickle: bool, flat: Any = None) -> None:
    """Check the record ``header`` (a ``steprecord.Header`` whose checksums were verified) against the live
    ``state`` and its ``optimizers`` before any replay; CorruptCheckpointError naming the file if it does not fit.
    ``flat``: ``flatten(state, template=True)`` when the caller checks several records."""
    path = header.path
    try:
        for call in header.doc["calls"]:
            _check_call(call, optimizers, path, allow_pickle)
        check_rest(flatten(state, template=True) if flat is None else flat, header.doc["rest"], path, live,
                   allow_pickle)
    except LiferaftError as e:
        if path in str(e):
            raise
        raise _bad(path, f"does not decode ({e})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"is malformed ({type(e).__name__}: {str(e)[:80]})") from None


def check_records(records: dict[int, Any], state: Any, optimizers: list[torch.optim.Optimizer], allow_pickle: bool,
                  full: int, n: int) -> tuple[Any, ...]:
    """``check_record`` of the records full+1..n (``records[step][0]``: a checksum-verified Header), before any
    replay: ("ok",), or ("bad", why, step) for the first that does not fit the live state."""
    flat = flatten(state, template=True)
    live = optsteps.tensor_ids(optimizers)
    for step in range(full + 1, n + 1):
        try:
            check_record(records[step][0], state, optimizers, live, allow_pickle, flat)
        except LiferaftError as e:
            return ("bad", f"{type(e).__name__}: {e}", step)
    return ("ok",)


def owner_id(owner: str) -> str:
    """The step log's namespace and the owner every record names: a digest of the manager's root, so that two
    managers sharing a memory tier's job id and base keep their logs apart, and a restart of one finds its own."""
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


def lock_writer(root: str, name: str) -> int:
    """An exclusive ``flock`` on ``root/<name>.lock``, as a file descriptor (held until the StepLog closes it with
    ``namespace.let_go``, freed by the kernel when the process dies; none in a forked child): a second live StepLog
    of the same namespace and rank is refused."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"{name}.lock")
    fd = namespace.exclusive(path)          # (a forked child holds none of it: ``tiers.namespace``)
    if fd is None:
        raise CheckpointBusyError(f"{path}: another live manager of the same root writes this per-step log (rank "
                                  f"{name}); close() it first, or give this manager another root")
    return fd


def check_own(raw: dict[int, Any], full: int, n: int, rank: int, owner: str, world: int,
              layout: tuple[str, str]) -> tuple[Any, ...]:
    """Decode and check rank ``rank``'s records ``full+1..n`` in ``raw`` (step -> (header or None if not yet
    verified, bytes, where)): each must be whole, of its step, rank and ``owner``, and written by this ``world``
    and ``layout`` (fingerprint, description); keeps them as ``raw[step] = (header, bytes)``. ("ok",),
    ("layout", why) or ("bad", why, step)."""
    for step in range(full + 1, n + 1):
        h, data, where = raw[step]
        try:
            if h is None:
                h = parse_record(data, where)
                if h is not None:
                    verify_record(h, data)                    # every tensor's checksum, before any replay
            if h is None or h.step != step or h.doc["rank"] != rank or h.doc.get("owner") != owner:
                raise LiferaftError(f"{where}: not the record of step {step} of rank {rank}")
            if h.doc["layout"] != layout[0] or h.doc["world"] != world:
                return ("layout", f"{where}: written by world size {h.doc['world']}, replaying into {layout[1]}")
            raw[step] = (h, data)
        except (LiferaftError, KeyError, TypeError) as e:
            return ("bad", f"{type(e).__name__}: {e}", step)
    return ("ok",)


def replay_record(header: Header, data: Any, opts: list[torch.optim.Optimizer], allow_pickle: bool) -> None:
    """Run the optimizer steps of the record ``header`` / ``data`` (checked by ``check_own`` and
    ``check_records``) through ``opts``, its gradients as views into ``data``."""
    payload = memoryview(data)[:header.header_off]

    def value(v: Any, key: str) -> Any:
        if isinstance(v, dict) and set(v) == {"$t"}:
            return tensor_at(v["$t"], payload, header.path, header.algo)
        return decode_value(v, key, allow_pickle)

    for call in header.doc["calls"]:
        i = call["opt"]
        if type(i) is not int or not 0 <= i < len(opts):
            raise LiferaftError(f"{header.path}: the record names optimizer {i}; the state has {len(opts)}")
        grads = [None if e is None else tensor_view(e, payload, header.path) for e in call["grads"]]
        groups = [{k: value(v, k) for k, v in g.items()} for g in call["groups"]]
        optsteps.replay_call(opts[i], grads, groups, {k: value(v, k) for k, v in call["kwargs"].items()},
                             {k: value(v, k) for k, v in call.get("attrs", {}).items()})


__all__ = ["check_own", "check_record", "check_records", "check_rest", "lock_writer", "owner_id", "replay_record"]
