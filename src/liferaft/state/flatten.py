"""Flatten a nested training state into tensor leaves, plain values and containers (and back).

This is the only layer that knows DTensor, ``Sharded``, modules and optimizers. Walking rules:

- ``Sharded`` / ``DTensor`` / ``torch.Tensor`` are tensor leaves (a plain tensor is replicated: every rank
  holds all of it); numpy arrays and bytes over ``INLINE_LIMIT`` bytes are stored like replicated tensors;
- objects with ``state_dict()``/``load_state_dict()`` are replaced by their adapter's state dict, which is
  walked like a dict (container kind ``"stateful"``);
- dicts (and dict subclasses such as the OrderedDict of ``state_dict()``) / lists / tuples that hold any of the
  above are walked (keys must be str or int); any other value,
  including a container of plain values, is one value leaf encoded by ``liferaft.state.values``.

Keys are the path parts joined by ``"."`` (``model.layers.0.weight``); two paths giving the same key are an error.

A plain tensor (or numpy array / bytes stored as one) is *assumed* replicated, and a save checks the assumption:
each rank hashes it (``TensorLeaf.compare``) and one whose copies differ is stored per rank (``planning.save_plan``).
Tensors of an ``nn.Module`` or an ``Optimizer`` are exempt (their replication is the parallelism's contract, and
hashing them would cost a pass over the model at every save), and so are those of their state dicts saved as
dicts (:func:`is_model_or_optimizer_state_dict`: ``model.state_dict()`` under DDP holds BatchNorm running
statistics that differ between ranks after every forward, and are replicated by contract all the same — one
holder's copy is written, as PyTorch DCP does).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from liferaft.errors import InvalidStateError
from liferaft.format.limits import MAX_NESTING
from liferaft.format.manifest import ContainerEntry, PathPart
from liferaft.planning.geometry import Box
from liferaft.state.adapters import Adapter, is_stateful, make_adapters, replicated_by_contract
from liferaft.state.sharded import Sharded

INLINE_LIMIT = 64 * 1024


@dataclass
class TensorLeaf:
    """One tensor of the state as this rank holds it: local boxes of the global tensor and their tensors."""

    key: str
    path: tuple[PathPart, ...]
    kind: str                                 # "tensor" | "numpy" | "bytes"
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: list[tuple[Box, torch.Tensor]]
    #: a plain leaf (tensor, numpy, bytes) outside a module / optimizer: its copies are compared across ranks
    compare: bool = False
    #: a DTensor over a mesh of the ranks ``0..n-1`` in row-major order with Shard, _StridedShard and Replicate
    #: placements: the mesh's shape and, per mesh dimension, the tensor dimension it shards (``(dim, split
    #: factor)`` for a _StridedShard; None: it replicates); see ``planning.layouts``
    spec: tuple[tuple[int, ...], tuple[Any, ...]] | None = None
    #: a DTensor on a sub-mesh (``spec`` over its root): the root's ranks outside the sub-mesh that hold the same
    #: key are replicas by the DTensor contract, not by a Replicate placement (``core.stages.same_replicas``
    #: checks them: pipeline stages that name their layers alike look like this)
    implied: bool = False

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass
class FlatState:
    tensors: list[TensorLeaf] = field(default_factory=list)
    values: list[tuple[str, tuple[PathPart, ...], Any]] = field(default_factory=list)
    containers: list[ContainerEntry] = field(default_factory=list)
    statefuls: list[tuple[tuple[PathPart, ...], Adapter, dict]] = field(default_factory=list)
    nodes: dict[tuple[PathPart, ...], Any] = field(default_factory=dict)   # path -> walked container object
    #: (load templates) subtrees a checkpoint may lack as a whole, and checkpoint keys the state does not load:
    #: see ``liferaft.state.matching``
    optional: list[tuple[PathPart, ...]] = field(default_factory=list)
    not_persisted: set[str] = field(default_factory=set)


def key_of(path: tuple[PathPart, ...]) -> str:
    return ".".join(str(p) for p in path)


def _dtensor_type() -> type | None:
    """DTensor, if anything imported it (a state cannot hold one otherwise): saves the import on first use."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _refuse_exotic(t: torch.Tensor, key: str) -> None:
    """A tensor liferaft cannot save or load into, refused before anything asks for its shape (a nested tensor's
    ``shape`` raises): nested (jagged or strided) tensors, and tensor subclasses that intercept torch's operators
    (``__torch_dispatch__``: FakeTensor, functional or user wrappers; DTensor has its own branch) — InvalidStateError
    naming the key."""
    if getattr(t, "is_nested", False):
        raise InvalidStateError(f"key {key!r}: a nested tensor; liferaft saves dense (strided) tensors: save "
                                ".unbind() of it (a list of tensors), or .to_padded_tensor(0)")
    if getattr(type(t), "__torch_dispatch__", None) is not _PLAIN_DISPATCH:
        raise InvalidStateError(f"key {key!r}: a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass "
                                "that intercepts torch operations (__torch_dispatch__); save or load into a plain "
                                "torch.Tensor (or nn.Parameter) holding its values")


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


@functools.lru_cache(maxsize=65536)
def _local_runs(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...],
                coordinate: tuple[int, ...] | None
                ) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, int, int], ...], ...]]:
    """This rank's local shape of a DTensor and, per dimension, the runs ``(local start, global start, length)``
    of consecutive global indices its local indices map to (one run per dimension unless a ``_StridedShard``
    interleaves). Cached on ``coordinate`` (this rank's place in ``mesh``): saves of a model ask for the same few
    layouts thousands of times."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    assert coordinate is not None, "this rank is not in the DTensor's mesh"
    local = list(shape)
    index: dict[int, Any] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):      # Replicate
            continue
        size, idx = _get_shard_size_and_offsets(local[p.dim], mesh.size(mesh_dim), coordinate[mesh_dim], p,
                                                index.get(p.dim), shape[p.dim], False)
        local[p.dim] = size
        index[p.dim] = idx if size else idx[:0]
    runs = []
    for d, n in enumerate(shape):
        if d not in index:
            runs.append(((0, 0, n),))
            continue
        dim_runs: list[list[int]] = []
        for li, g in enumerate(int(i) for i in index[d].tolist()):
            if dim_runs and g == dim_runs[-1][1] + dim_runs[-1][2]:
                dim_runs[-1][2] += 1
            else:
                dim_runs.append([li, g, 1])
        runs.append(tuple((r[0], r[1], r[2]) for r in dim_runs) or ((0, 0, 0),))
    return tuple(local), tuple(runs)


def _dtensor_parts(dt: Any, key: str) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor this rank holds, each with the local view holding it: one box for Shard and
    Replicate placements; several when a ``_StridedShard`` (FSDP2 over TP) interleaves rows."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in dt.placements:
        if not isinstance(p, (Shard, _StridedShard, Replicate)):
            raise InvalidStateError(
                f"key {key!r}: DTensor placement {p!r} is not supported yet (Shard, _StridedShard and Replicate "
                "are); redistribute the tensor to Shard/Replicate placements before saving")
    if not _mesh_dims_ascending(dt.device_mesh, tuple(not isinstance(p, Replicate) for p in dt.placements)):
        raise InvalidStateError(
            f"key {key!r}: DTensor on a mesh {dt.device_mesh.mesh.tolist()} one of whose sharding dimensions lists "
            "its ranks out of increasing order: torch's collectives on that dimension order its ranks by number, its "
            "coordinates by position, so the box this rank holds is not the one its coordinate names. Build the "
            "mesh with each dimension's ranks in increasing order (init_device_mesh does), or save "
            "dt.full_tensor()")
    local = getattr(dt, "_local_tensor", None)      # what to_local() returns, without its autograd overhead
    if not isinstance(local, torch.Tensor):
        local = dt.to_local()
    coordinate = dt.device_mesh.get_coordinate()
    shape, runs = _local_runs(tuple(dt.shape), dt.device_mesh, tuple(dt.placements),
                              tuple(coordinate) if coordinate is not None else None)
    if tuple(local.shape) != tuple(shape):
        raise InvalidStateError(f"key {key!r}: DTensor local shape {list(local.shape)} differs from the shape "
                                f"{list(shape)} its placements imply")
    parts = []
    for combo in itertools.product(*runs):
        view = local
        for d, (lo, _, n) in enumerate(combo):
            if (lo, n) != (0, local.shape[d]):
                view = view.narrow(d, lo, n)
        parts.append(((tuple(g for _, g, _ in combo), tuple(n for _, _, n in combo)), view))
    return parts


def _spec(dt: Any) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """``TensorLeaf.spec`` of the DTensor ``dt`` (None: its layout is not one ``planning.layouts`` describes)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shards: list[Any] = []
    for p in dt.placements:
        if type(p) is Shard:
            shards.append(p.dim)
        elif type(p) is _StridedShard:
            shards.append((p.dim, p.split_factor))
        elif type(p) is Replicate:
            shards.append(None)
        else:
            return None
    mesh = dt.device_mesh
    over_root = _over_root(mesh, tuple(shards))        # (a sub-mesh is described over its root, in order or not)
    if over_root is not None or _has_root(mesh):
        return over_root
    shape, in_order = _mesh_ranks(mesh)
    return (shape, tuple(shards)) if in_order else None


def _has_root(mesh: Any) -> bool:
    """Whether ``mesh`` is a sub-mesh of another (a private DeviceMesh API: without it, assume not)."""
    try:
        return mesh._get_root_mesh() is not mesh
    except Exception:  # noqa: BLE001
        return False


def _over_root(mesh: Any, shards: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """The spec over the root mesh of the sub-mesh ``mesh`` (FSDP2 on ``mesh["dp"]`` of a (dp, tp) mesh): each
    dimension of the root that the sub-mesh lacks replicates (the job holds the same tensor on every sub-mesh
    that slices it, as it does a plain tensor on every rank). None when the root is not in order or the
    dimensions cannot be matched by name. (A rank's box is checked against the spec before it is used.)"""
    try:
        root = mesh._get_root_mesh()
        names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    except Exception:  # noqa: BLE001 - a private DeviceMesh API: without it, the save gathers its metadata
        return None
    if root is mesh or not names or not root_names or not set(names) <= set(root_names) or \
            len(set(names)) != len(names) or not _mesh_ranks(root)[1]:
        return None
    by_name = dict(zip(names, shards))
    order = [root_names.index(n) for n in names]
    if order != sorted(order):
        return None
    return _mesh_ranks(root)[0], tuple(by_name.get(n) for n in root_names)


@functools.lru_cache(maxsize=256)
def _mesh_dims_ascending(mesh: Any, sharding: tuple[bool, ...]) -> bool:
    """Whether each 1-D slice of ``mesh`` along each of its ``sharding`` dimensions holds its ranks in increasing
    order (the order of the process group torch makes for it: ``new_group`` sorts its ranks; along a replicating
    dimension the order does not matter)."""
    ranks = mesh.mesh
    return all(bool((ranks.diff(dim=d) > 0).all()) for d in range(ranks.dim())
               if ranks.shape[d] > 1 and (d >= len(sharding) or sharding[d]))


@functools.lru_cache(maxsize=256)
def _mesh_ranks(mesh: Any) -> tuple[tuple[int, ...], bool]:
    """The shape of ``mesh``'s rank tensor, and whether it holds the ranks ``0..n-1`` in row-major order. Cached
    per mesh (a DeviceMesh's ranks never change, and its ``mesh`` property builds a new tensor on every call,
    ~20 µs: with the order check, once per DTensor, it was 14 of a 2-rank flatten's 21 ms for 444 DTensors)."""
    ranks = mesh.mesh
    flat = ranks.reshape(-1)
    return tuple(ranks.shape), bool(torch.equal(flat, torch.arange(flat.numel(), dtype=flat.dtype)))


def is_model_or_optimizer_state_dict(v: Any) -> bool:
    """Whether ``v`` is the state dict of a module or an optimizer, saved as a dict rather than as the object
    (``{"model": model.state_dict(), "optim": opt.state_dict()}``, the common DDP pattern): a module's is the
    ``OrderedDict`` that ``nn.Module.state_dict()`` (and so ``get_model_state_dict``, under DDP, FSDP2 and
    ``torch.compile`` alike) marks with its ``_metadata`` attribute; an optimizer's is a dict with exactly the
    keys ``state`` and ``param_groups``. Their tensors follow the data-parallel contract like the objects'."""
    if not isinstance(v, dict):
        return False
    return isinstance(getattr(v, "_metadata", None), dict) or \
        (len(v) == 2 and "state" in v and "param_groups" in v and isinstance(v["state"], dict)
         and isinstance(v["param_groups"], (list, tuple)))


def _is_leaf_array(v: Any) -> bool:
    return type(v) is np.ndarray and not v.dtype.hasobject and v.dtype.fields is None and v.dtype.kind != "V" \
        and v.dtype.isnative and v.nbytes > INLINE_LIMIT    # (a masked or record array, a structured dtype: values)


def _is_leaf_bytes(v: Any) -> bool:
    return isinstance(v, (bytes, bytearray)) and len(v) > INLINE_LIMIT


_PLAIN = frozenset({int, float, str, bool, type(None)})    # exact types that are never tensors nor stateful


class _Walker:
    def __init__(self, template: bool = False, world: int | None = None) -> None:
        self.flat = FlatState()
        self.world = world
        self.dtensor = _dtensor_type()
        self.keys: dict[str, tuple[PathPart, ...]] = {}
        self.adapters: dict[int, Adapter] = {}
        self.template = template
        self.trusted = 0            # > 0 while walking the state dict of a module / optimizer
        self.open: set[int] = set()     # ids of the containers being walked (a state that contains itself)

    def _claim(self, path: tuple[PathPart, ...]) -> str:
        key = key_of(path)
        other = self.keys.get(key)
        if other is not None and other != path:
            raise InvalidStateError(f"paths {list(other)} and {list(path)} both map to key {key!r}; rename one")
        self.keys[key] = path
        return key

    def needs_walk(self, v: Any, path: tuple[PathPart, ...]) -> bool:
        """Whether the container ``v`` at ``path`` holds a tensor or a stateful object anywhere (else it is one plain
        value). Iterative; containers nested deeper than MAX_NESTING (counting ``path``) are refused here, one
        holding itself is walked once (and refused by the walk or ``state.values.encode_value``)."""
        todo, seen = [(v, 0)], set()
        while todo:
            x, depth = todo.pop()
            if isinstance(x, (torch.Tensor, Sharded)) or is_stateful(x) or _is_leaf_array(x) or _is_leaf_bytes(x):
                return True
            if (isinstance(x, dict) or type(x) in (list, tuple)) and id(x) not in seen:
                if depth + len(path) > MAX_NESTING:
                    _too_deep(path)
                seen.add(id(x))
                items = x.values() if isinstance(x, dict) else x
                types = set(map(type, items))
                if any(issubclass(t, torch.Tensor) for t in types):
                    return True                                 # (a tensor right here: no need to queue the rest)
                if not _PLAIN.issuperset(types):                # (only plain scalars: nothing to look into)
                    todo.extend((y, depth + 1) for y in items)
        return False

    def walk(self, v: Any, path: tuple[PathPart, ...]) -> None:
        if isinstance(v, Sharded):
            _refuse_exotic(v.local, key_of(path))
            self._tensor(path, "tensor", v.local, v.global_shape, v.boxes())
        elif self.dtensor is not None and isinstance(v, self.dtensor):
            key = key_of(path)
            spec = _spec(v)
            self._tensor(path, "tensor", v, tuple(v.shape), _dtensor_parts(v, key), spec=spec,
                         implied=spec is not None and math.prod(spec[0]) > v.device_mesh.size())
        elif isinstance(v, torch.Tensor):
            _refuse_exotic(v, key_of(path))
            self._tensor(path, "tensor", v, tuple(v.shape), [((tuple(0 for _ in v.shape), tuple(v.shape)), v)],
                         compare=not self.trusted)
        elif _is_leaf_array(v):
            try:
                t = torch.from_numpy(np.ascontiguousarray(v))
            except TypeError:
                self._value(path, v)
                return
            self._tensor(path, "numpy", t, tuple(t.shape), [((tuple(0 for _ in t.shape), tuple(t.shape)), t)],
                         compare=not self.trusted)
        elif _is_leaf_bytes(v):
            t = torch.frombuffer(bytearray(v), dtype=torch.uint8)
            self._tensor(path, "bytes", t, (len(v),), [(((0,), (len(v),)), t)], compare=not self.trusted)
        elif is_stateful(v):
            if id(v) in self.open:
                self._container(path, "stateful", v)         # (raises: the object holds itself)
            adapter = self.adapters.get(id(v))
            if adapter is None:         # an object inside another's state_dict(): adapted on its own
                adapter = self.adapters[id(v)] = make_adapters([v], self.world)[id(v)]
            template = getattr(adapter, "load_template", None) if self.template else None
            sd = template() if template is not None else adapter.state_dict()
            if not isinstance(sd, dict):
                raise InvalidStateError(f"key {key_of(path)!r}: state_dict() of {type(v).__qualname__} returned "
                                        f"{type(sd).__qualname__}, expected a dict")
            self.flat.statefuls.append((path, adapter, sd))
            if self.template:
                self.flat.optional.extend(path + tuple(rel) for rel in getattr(adapter, "optional", ()))
                not_persisted = getattr(adapter, "not_persisted", None)
                if not_persisted is not None:
                    self.flat.not_persisted.update(key_of(path + (name,)) for name in not_persisted())
            role = "module" if isinstance(v, torch.nn.Module) else \
                "optimizer" if isinstance(v, torch.optim.Optimizer) else None
            trusted = replicated_by_contract(v)
            self.trusted += trusted
            self.open.add(id(v))
            try:
                self._container(path, "stateful", sd, role, f"{type(v).__module__}.{type(v).__qualname__}")
            finally:
                self.trusted -= trusted
                self.open.discard(id(v))
        elif (isinstance(v, dict) or type(v) in (list, tuple)) and (not path or self.needs_walk(v, path)):
            trusted = is_model_or_optimizer_state_dict(v)
            self.trusted += trusted
            try:
                self._container(path, "dict" if isinstance(v, dict) else {list: "list", tuple: "tuple"}[type(v)], v)
            finally:
                self.trusted -= trusted
        else:
            self._value(path, v)

    def _container(self, path: tuple[PathPart, ...], kind: str, v: Any, role: str | None = None,
                   cls: str | None = None) -> None:
        if len(path) >= MAX_NESTING:
            _too_deep(path)
        if id(v) in self.open:
            raise InvalidStateError(f"key {key_of(path)!r}: the state contains itself there (a {type(v).__name__} "
                                    f"that holds itself, directly or through other containers or objects); a "
                                    "state must be a tree: break the cycle before saving or loading")
        self.open.add(id(v))
        try:
            self._children(path, kind, v, role, cls)
        finally:
            self.open.discard(id(v))

    def _children(self, path: tuple[PathPart, ...], kind: str, v: Any, role: str | None, cls: str | None) -> None:
        items = list(v.items() if isinstance(v, dict) else enumerate(v))
        self.flat.containers.append(ContainerEntry(path=path, kind=kind, children=tuple(k for k, _ in items),
                                                   role=role, cls=cls))
        self.flat.nodes[path] = v
        for k, x in items:
            if type(k) not in (str, int):
                raise InvalidStateError(f"key {key_of(path)!r}: dict key {k!r} of type {type(k).__qualname__} "
                                        "is not supported next to tensors; use str or int keys")
            self.walk(x, path + (k,))

    def _tensor(self, path: tuple[PathPart, ...], kind: str, t: Any, shape: tuple[int, ...],
                parts: list[tuple[Box, torch.Tensor]], compare: bool = False,
                spec: tuple[tuple[int, ...], tuple[Any, ...]] | None = None, implied: bool = False) -> None:
        key = self._claim(path)
        if t.dtype not in _SUPPORTED:
            raise InvalidStateError(f"key {key!r}: tensors of dtype {t.dtype} are not supported")
        if t.is_meta or any(p.is_meta for _, p in parts):
            raise InvalidStateError(f"key {key!r}: tensor is on the meta device and has no data")
        if any(p.layout != torch.strided for _, p in parts):
            raise InvalidStateError(f"key {key!r}: a {parts[0][1].layout} tensor; liferaft saves dense (strided) "
                                    "tensors: save .to_dense() of it, or its indices and values")
        if any(p.is_conj() or p.is_neg() for _, p in parts):
            if self.template:           # a load would have to write through the lazy bit
                raise InvalidStateError(f"key {key!r}: the state holds a conjugate or negative view; load into "
                                        "a tensor without the lazy bit (.resolve_conj() / .resolve_neg())")
            parts = [(box, p.resolve_conj().resolve_neg()) for box, p in parts]     # (a copy: what it reads as)
        self.flat.tensors.append(TensorLeaf(key=key, path=path, kind=kind, dtype=t.dtype, shape=tuple(shape),
                                            parts=parts, compare=compare, spec=spec, implied=implied))

    def _value(self, path: tuple[PathPart, ...], v: Any) -> None:
        self.flat.values.append((self._claim(path), path, v))


def _storage_short(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes the storage of ``t`` holds, bytes its shape and strides reach) when the storage is too small (its
    storage resized or freed behind the tensor's back, as FSDP does); None when it holds the tensor. A copy from or
    into such a tensor by address would read or write past its storage."""
    if t.numel() == 0:
        return None
    reach = (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    try:
        have = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):     # (a tensor without a storage of its own: refused elsewhere)
        return None
    return (have, reach) if have < reach else None


def _too_deep(path: tuple[PathPart, ...]) -> None:
    shown = key_of(path[:8]) + (f"... ({len(path)} levels)" if len(path) > 8 else "")
    raise InvalidStateError(f"key {shown!r}: the state nests containers deeper than {MAX_NESTING} levels (or "
                            "contains itself); flatten it (liferaft keys are paths of at most "
                            f"{MAX_NESTING} parts)")


_SUPPORTED = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
              torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def _collect_statefuls(state: Any, out: list[Any], seen: set[int]) -> None:
    """The stateful objects in the containers of ``state``, in walking order (each once). Iterative and bounded:
    a cycle or a nesting too deep is reported by the walk that follows, naming the path."""
    todo = [(state, 0)]
    while todo:
        v, depth = todo.pop()
        if id(v) in seen or depth > MAX_NESTING + 1:
            continue
        if is_stateful(v) and not isinstance(v, torch.Tensor):
            seen.add(id(v))
            out.append(v)
        elif isinstance(v, dict) or type(v) in (list, tuple):
            seen.add(id(v))
            todo.extend((x, depth + 1) for x in reversed(list(v.values() if isinstance(v, dict) else v)))


def flatten(state: Any, *, template: bool = False, world: int | None = None,
            adapters: dict[int, Adapter] | None = None) -> FlatState:
    """Flatten ``state`` (see module doc). Calls ``state_dict()`` on stateful objects once (``template``: for a
    load, their ``load_template()`` where they have one, and records what a checkpoint may lack or hold beyond
    the state: ``FlatState.optional`` / ``not_persisted``). ``world``: the size of the process group the save or
    load runs over (adapters that record it, the StatefulDataLoader's, take it; None: the default group's).
    ``adapters``: replacements for some objects' adapters, by ``id(obj)`` (the per-step log's cheaper walks)."""
    if not isinstance(state, dict) and type(state) not in (list, tuple) and not is_stateful(state):
        raise InvalidStateError(f"state must be a dict, list, tuple or an object with state_dict(); got "
                                f"{type(state).__qualname__}")
    w = _Walker(template, world)
    objs: list[Any] = []
    _collect_statefuls(state, objs, set())
    given = adapters or {}
    # (an optimizer's adapter pairs it with the module owning its parameters: that walk needs every module, the
    # others only the objects without a replacement — the per-step walk makes none, or only the modules')
    todo = objs if any(isinstance(o, torch.optim.Optimizer) and id(o) not in given for o in objs) else \
        [o for o in objs if id(o) not in given]
    w.adapters = {**make_adapters(todo, world), **given}
    w.walk(state, ())
    # (after the whole walk: a ``state_dict()`` called late in it may free the storage of a tensor walked before)
    for leaf in w.flat.tensors:
        for _, part in leaf.parts:
            short = _storage_short(part)
            if short is not None:
                raise InvalidStateError(
                    f"key {leaf.key!r}: the tensor's storage holds {short[0]} bytes, fewer than its shape and "
                    f"strides reach ({short[1]}): its storage was resized or freed (FSDP frees a parameter's "
                    "storage outside forward and backward). Pass the state the framework's state_dict gives, or "
                    "tensors whose storage holds their data")
    return w.flat
