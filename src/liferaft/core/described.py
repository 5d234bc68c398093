"""What the ranks' tensors are described by before a save is planned on each rank (``core.phases``): each
tensor's compact layout (``planning.layouts``), the layouts inferred for hand-made shards from the boxes of a few
ranks (the probes), and the digest the ranks compare to agree on all of it. Pure functions of one rank's
flattened state; the exchanges are ``core.phases``'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from liferaft.codecs.checksum import digest
from liferaft.errors import InvalidStateError
from liferaft.planning.geometry import numel
from liferaft.planning.layouts import Layout, as_ordered, infer_layout, layout_box, probe_ranks
from liferaft.planning.save_plan import RankMeta
from liferaft.state.flatten import FlatState


def layouts_of(flat: FlatState, rank: int, world: int) -> tuple[Layout | None, ...] | None:
    """Each tensor's compact layout over ``world`` ranks, a regular one checked against the box this rank holds;
    None for a tensor of one box whose layout is inferred (``infer_unknown``: a hand-made shard, a DTensor on a mesh of
    the ranks in another order). None overall when some tensor has none (several boxes on a rank, a DTensor on
    another mesh or with another placement whose box disagrees with it). The boxes of a ``_StridedShard`` are
    its DTensor's; rank 0 checks at the commit that the chunks of a layout's first save tile every tensor
    (``_finish_own``)."""
    out: list[Layout | None] = []
    for t in flat.tensors:
        if t.spec is not None:
            layout = Layout(*t.spec)
            if layout.world != world:
                if len(t.parts) != 1:
                    return None
                out.append(None)
                continue
        elif len(t.parts) == 1 and t.parts[0][0] == (tuple(0 for _ in t.shape), t.shape):
            layout = Layout((world,), (None,))
        elif len(t.parts) == 1 and numel(t.shape) > 0:
            out.append(None)
            continue
        else:
            return None
        if not layout.regular:
            ordered = as_ordered(layout, t.shape)   # (FSDP2 over TP, evenly split: a nested split, checked below)
            if ordered is None:
                out.append(layout)
                continue
            layout = ordered
        if len(t.parts) != 1:
            return None
        held, want = t.parts[0][0], layout_box(layout, t.shape, rank)
        if held != want and not (numel(held[1]) == 0 == numel(want[1])):
            return None
        out.append(layout)
    return tuple(out)


def fill_inferred(layouts: tuple[Layout | None, ...], inferred: tuple[Layout | None, ...] | None, flat: FlatState,
          rank: int) -> tuple[Layout, ...] | None:
    """``layouts`` with its unknown entries (None) taken in order from ``inferred``, or None unless each gives
    this rank exactly the box it holds of that tensor."""
    if inferred is None or len(inferred) != sum(la is None for la in layouts):
        return None
    it, out = iter(inferred), []
    for t, la in zip(flat.tensors, layouts):
        if la is None:
            la = next(it)
            held = t.parts[0][0]
            want = layout_box(la, t.shape, rank) if la is not None and la.regular else None
            if want is None or (held != want and not (numel(held[1]) == 0 == numel(want[1]))):
                return None
        out.append(la)
    return tuple(out)


def infer_unknown(shapes: Sequence[tuple[int, ...]], probed: Mapping[int, Any] | Sequence[Any], world: int
                  ) -> tuple[Layout | None, ...]:
    """(On rank 0) the layout of each tensor of ``shapes`` (the tensors whose layout is unknown, in order) from the
    boxes the ``planning.layouts.probe_ranks`` sent (``probed[r]``: rank ``r``'s message, one box per tensor), or
    None for one whose boxes follow none; tensors of one shape whose probes hold the same boxes are inferred
    once (and share one ``Layout``)."""
    probes = probe_ranks(world)
    msgs = []
    for r in probes:
        msg = probed[r]
        if not isinstance(msg, tuple) or len(msg) != len(shapes):
            raise InvalidStateError(f"rank {r} described {0 if msg is None else len(msg)} tensors of unknown "
                                    f"layout, rank 0 {len(shapes)}")
        msgs.append(msg)
    seen: dict[Any, Layout | None] = {}
    out = []
    for j, shape in enumerate(shapes):
        key = (shape, tuple(m[j] for m in msgs))
        if key not in seen:
            seen[key] = infer_layout(shape, dict(zip(probes, key[1])), world)
        out.append(seen[key])
    return tuple(out)


def digest62(data: bytes) -> int:
    """A 62-bit digest of ``data``, never 0 (0 votes "none" in the ranks' all-reduces): what the ranks compare."""
    return (int(digest(data), 16) >> 2) | 1


def layout_digest(meta: RankMeta, layouts: tuple[Layout | None, ...], alignment: int, chunk_bytes: int,
                  chunk_tables: bool = True, *, values: bool = True, implied: tuple[int, ...] = (),
                  incremental: bool = False) -> int:
    """A 62-bit digest (never 0) of what every rank must agree on to plan on its own: every tensor's key, path,
    kind, dtype, global shape and layout (None: to be inferred), in order, the options the plan and the commit
    depend on, and (``values``) the digests of the plain tensors that are compared and the containers (ranks
    whose containers differ plan gathered, where a conflict is refused before anything is written). Without
    ``values``: what the inferred layouts are kept by (``caches.INFERRED``), unchanged when a compared plain
    tensor's value changes between saves. ``implied``: the positions of the tensors replicated by their
    sub-mesh alone (``TensorLeaf.implied``), whose copies a save then compares. ``incremental``: the save
    references an incremental base from each rank's plan (``core.base``: every rank then takes part in its
    exchanges)."""
    described = [(t.key, t.path, t.kind, t.dtype, t.shape) + ((la.mesh, la.shards, la.order) if la else ("?",))
                 for t, la in zip(meta.tensors, layouts)]
    extra = (meta.digests, meta.containers) if values else ()
    return digest62(repr((described, alignment, chunk_bytes, chunk_tables, extra, implied)
                         + ((True,) if incremental else ())).encode())


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3 of a plain tensor's bytes (row-major), to tell whether its copies on the ranks are equal."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return digest(memoryview(flat.contiguous().view(torch.uint8).numpy()))


def implied_of(flat: FlatState) -> tuple[int, ...]:
    """The positions of the tensors whose replicas are implied by a sub-mesh alone (``TensorLeaf.implied``)."""
    return tuple(i for i, t in enumerate(flat.tensors) if t.implied)
