"""The per-step log's pure parts: where a rank's records are copied, which chain of records a recovery can
replay, what a node must fetch, and the check of every tensor of a record against its checksum."""

from __future__ import annotations

from typing import Any

from liferaft.errors import CorruptCheckpointError
from liferaft.tiers.steprecord import Header, tensor_at


def verify_record(header: Header, data: bytes | bytearray | memoryview) -> None:
    """Check every tensor of the record ``data`` against its checksum (CorruptCheckpointError naming the file)."""
    payload = memoryview(data)[:header.header_off]
    try:
        entries = [e for call in header.doc["calls"] for e in call["grads"] if e is not None]
        entries += [v["$t"] for call in header.doc["calls"] for part in call["groups"] + [call["kwargs"], call.get("attrs", {})]
                    for v in part.values() if isinstance(v, dict) and set(v) == {"$t"}]
        entries += [e for es in header.doc["rest"]["tensors"].values() for e in es]
    except (KeyError, TypeError, AttributeError):
        raise CorruptCheckpointError(f"{header.path}: step record header is malformed") from None
    for e in entries:
        tensor_at(e, payload, header.path, header.algo)


def bytearray_np(data: bytearray) -> Any:
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8)


AUTO_SHARE = 4              # max_steps="auto": the rings of a node take at most 1/AUTO_SHARE of its shared memory
AUTO_MIN, AUTO_MAX = 4, 256
AUTO_SLACK = 64 << 10       # a slot's room beyond its record (``stepslot.Slot.reserve(whole=True)``: at least this,
#                             1/64 of the record above 4 MiB), counted per slot
AUTO_FDS = 4                # the rings' slot files take at most 1/AUTO_FDS of the process's descriptors


def ring_size(record_bytes: int, shm_bytes: int, ranks_on_node: int, kept: int,
              max_files: int | None = None) -> tuple[int, bool]:
    """``StepLogOptions(max_steps="auto")``: how many records a rank's ring holds, from the length of its first
    record (``record_bytes``), the size of the node's shared-memory file system, the ranks of the node sharing it,
    and the rings of other ranks' records this rank keeps (``kept``: its replication sources, counted as records
    of the same length: under DDP their gradients are held, not kept, so this overcounts). As many as fit in
    ``1/AUTO_SHARE`` of the file system, each slot counted as it is reserved (the record and its slack), within
    ``[AUTO_MIN, AUTO_MAX]`` and, with ``max_files`` (the process's descriptor limit), at most what
    ``1/AUTO_FDS`` of them hold open (two per slot file: its descriptor and its mapping's); and whether
    ``AUTO_MIN`` fit the memory (else the ring is ``AUTO_MIN`` all the same, and takes more than that share)."""
    record = max(0, record_bytes)
    per_slot = (record + max(AUTO_SLACK, record >> 6)) * (1 + max(0, kept))
    fits = max(0, shm_bytes) // AUTO_SHARE // max(1, ranks_on_node) // per_slot
    cap = AUTO_MAX if max_files is None else min(AUTO_MAX, max_files // AUTO_FDS // (2 * (1 + max(0, kept))))
    return max(AUTO_MIN, min(cap, fits)), fits >= AUTO_MIN


def targets(nodes: list[str], rank: int, replicas: int) -> list[int]:
    """The ranks holding copies of ``rank``'s records: the same local position on the next ``replicas`` nodes."""
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    mine = nodes[rank]
    pos = members[mine].index(rank)
    out = []
    for i in range(1, len(order)):
        if len(out) >= replicas:
            break
        node = order[(order.index(mine) + i) % len(order)]
        out.append(members[node][pos % len(members[node])])
    return out


def newest_chain(listing: list[dict], full: int, world: int) -> tuple[int, str]:
    """(N, why not further): the newest N with records full+1..N of every rank held by some node. Pure."""
    have = {k for held in listing for k in held}
    worlds = {v[2] for held in listing for v in held.values()}
    if worlds - {world}:
        return full, (f"records were written by world size {sorted(worlds - {world})}, this job has {world}: " \
                     "the per-step log replays only into the layout that wrote it")
    n = full
    while all((r, n + 1) in have for r in range(world)):
        n += 1
    return n, ""


def fetch_plan(listing: list[dict], nodes: list[str], full: int, n: int) -> list[tuple[int, int, int, str, int]]:
    """(step, holder, rank, slot name, length) for each record full+1..n that ``rank``'s node lacks. Pure."""
    plan = []
    for step in range(full + 1, n + 1):
        for rank in range(len(nodes)):
            if any((rank, step) in listing[h] for h in range(len(nodes)) if nodes[h] == nodes[rank]):
                continue
            holder = min(h for h in range(len(nodes)) if (rank, step) in listing[h])
            rel, length, _ = listing[holder][(rank, step)]
            plan.append((step, holder, rank, rel, length))
    return plan


__all__ = ["bytearray_np", "fetch_plan", "newest_chain", "targets", "verify_record"]
