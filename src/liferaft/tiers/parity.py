"""XOR parity across groups of nodes instead of full replicas (REFT): ``MemoryTier(parity=k)``, docs/TIERS.md.

Nodes, in order of first appearance, form groups of ``k`` (a last group of one joins the group before it); the
ranks at the same local position of a group's nodes form a *parity group* of ``m`` members. After a save, member
``i``'s data file ``D_i`` (zero-padded to the group's longest) is cut into ``m − 1`` stripes of ``S`` bytes, and
member ``j`` keeps ``P_j`` = XOR over ``i ≠ j`` of stripe ``(j − i − 1) mod m`` of ``D_i`` (RAID-5's rotation: every
stripe of every file lands in exactly one parity, never on its own node). Each node holds its own files plus
``1/(m − 1)`` of their size in parity, where a replica costs a full copy. When one member's node is lost, stripe
``s`` of its file is ``P_j`` XOR the other live members' stripes in ``P_j``, ``j = (i + 1 + s) mod m``: the group's
lowest live rank gathers those and writes the file into its node's memory, and the load then verifies every byte of
it against the manifest's checksums as it would any copy. Two losses in one group, or a parity that is missing,
leave the file unrecoverable from memory (the restore takes an older step, the root's copy or the remote's).

Files, per member: ``<node root>/parity/step-<n>/r<rank>.xor`` (``P_j``) and ``r<rank>.json``, its header (strict
JSON: ``format``, ``step``, ``members`` (ranks), ``index``, ``stripe`` (S), ``files`` (per member: data file name
and size)). Headers are hostile input: read with a size cap and checked (``read_header``) before anything is sized
from them.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.format.jsonsafe import loads
from liferaft.format.layout import DATA_DIR, data_file_rank, step_name
from liferaft.format.limits import MAX_INT
from liferaft.storage.files import open_read

FORMAT = "liferaft-parity/1"
PARITY_DIR = "parity"
MAX_HEADER = 1 << 20
ALIGN = 4096
PIECE = 4 << 20


# ---------------------------------------------------------------------------------------------- planning (pure)

def parity_group(nodes: Sequence[str], rank: int, k: int) -> list[int]:
    """The ranks of ``rank``'s parity group: the same local position on each node of its group of ``k`` nodes
    (nodes in order of first appearance; a last group of one node joins the group before it), in node order. A
    node with fewer ranks than ``rank``'s position has no member in it (so a rank whose position only its own node
    has is a group of one: no parity; ``save`` warns)."""
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    groups = [order[i:i + k] for i in range(0, len(order), k)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        last = groups.pop()
        groups[-1] = groups[-1] + last
    mine = nodes[rank]
    group = next(g for g in groups if mine in g)
    pos = members[mine].index(rank)
    out = []
    for n in group:
        if pos < len(members[n]):
            out.append(members[n][pos])
    return out if rank in out else [rank]


def stripe_size(sizes: Sequence[int]) -> int:
    """Bytes per stripe of a group whose members' files have ``sizes``: the longest cut into ``m − 1``, rounded up
    to ``ALIGN`` (at least one ``ALIGN``)."""
    m = len(sizes)
    per = -(-max(sizes, default=0) // max(1, m - 1))
    return max(ALIGN, -(-per // ALIGN) * ALIGN)


def holder_of(i: int, s: int, m: int) -> int:
    """The member whose parity holds stripe ``s`` of member ``i``'s file."""
    return (i + 1 + s) % m


def stripe_in(i: int, j: int, m: int) -> int:
    """Which stripe of member ``i``'s file is in member ``j``'s parity (``i ≠ j``)."""
    return (j - i - 1) % m


def rebuild_plan(lost: int, m: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """For member ``lost``'s file: per stripe ``s``, (s, the member ``j`` whose parity holds it, the (member,
    stripe) pairs of the other live members XORed into that parity)."""
    out = []
    for s in range(m - 1):
        j = holder_of(lost, s, m)
        out.append((s, j, [(i, stripe_in(i, j, m)) for i in range(m) if i not in (j, lost)]))
    return out


def rebuildable(headers: Mapping[int, Mapping[str, Any]], live_files: set[str], missing: set[str]) -> bool:
    """Whether every file of ``missing`` can be rebuilt from the parity ``headers`` live ranks hold (rank →
    header) and the data files live nodes hold (``live_files``). Pure."""
    for name in missing:
        r = data_file_rank(name)
        h = next((h for h in headers.values() if r in h["members"] and
                  h["files"][h["members"].index(r)][0] == name), None)
        if h is None:
            return False
        members, lost = h["members"], h["members"].index(r)
        for _, j, others in rebuild_plan(lost, len(members)):
            hj = headers.get(members[j])
            if hj is None or hj["members"] != members or hj["files"] != h["files"] or hj["stripe"] != h["stripe"]:
                return False
            if any(h["files"][i][1] and (h["files"][i][0] not in live_files or members[i] not in headers)
                   for i, _ in others):
                return False
    return True


# ---------------------------------------------------------------------------------------------- files

def drop(root: str, keep: Sequence[int]) -> None:
    """Remove the parity of every step but ``keep`` from the node root ``root``."""
    base = os.path.join(root, PARITY_DIR)
    if not os.path.isdir(base):
        return
    names = {step_name(s) for s in keep}
    for d in os.listdir(base):
        if d not in names:
            shutil.rmtree(os.path.join(base, d), ignore_errors=True)


def read_header(root: str, step: int, rank: int) -> dict[str, Any] | None:
    """This rank's parity header of ``step`` in the node root ``root``, checked; None if there is none or it does
    not hold (a damaged parity is no parity: the restore goes on without it)."""
    rel = _rel(step, rank, "json")
    try:
        fd = open_read(root, rel, limit=MAX_HEADER)     # (a regular file, no link followed, at most MAX_HEADER)
        with os.fdopen(fd, "rb") as f:
            doc = loads(f.read(MAX_HEADER + 1), os.path.join(root, rel), MAX_HEADER)
        fd = open_read(root, _rel(step, rank, "xor"))
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return _checked(doc, step, rank, size)
    except (OSError, LiferaftError, ValueError, TypeError, KeyError, IndexError):
        return None


def _rel(step: int, rank: int, ext: str) -> str:
    """A parity file's path under the node root."""
    return f"{PARITY_DIR}/{step_name(step)}/r{rank}.{ext}"


def _checked(doc: Any, step: int, rank: int, parity_bytes: int) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("step") != step:
        raise ValueError("not a parity header of this step")
    members, index, stripe, files = doc["members"], doc["index"], doc["stripe"], doc["files"]
    if not (isinstance(members, list) and 2 <= len(members) <= 1 << 20 and
            all(type(r) is int and 0 <= r <= MAX_INT for r in members) and len(set(members)) == len(members)):
        raise ValueError("bad members")
    if type(index) is not int or not 0 <= index < len(members) or members[index] != rank:
        raise ValueError("bad index")
    if type(stripe) is not int or not ALIGN <= stripe <= MAX_INT or stripe % ALIGN or parity_bytes != stripe:
        raise ValueError("bad stripe")
    if not isinstance(files, list) or len(files) != len(members):
        raise ValueError("bad files")
    for i, f in enumerate(files):
        if not (isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int and
                0 <= f[1] <= stripe * (len(members) - 1) and (not f[1] or (f[0].startswith(DATA_DIR + "/") and
                                                                         data_file_rank(f[0]) == members[i]))):
            raise ValueError("bad file entry")
    return doc


def _read_span(root: str, rel: str, off: int, n: int, out: torch.Tensor) -> None:
    """Bytes [off, off + n) of the file ``root/rel`` into ``out`` (zero past the file's end); the file opened the one
    safe way (``storage.files.open_read``: a regular file, no link followed)."""
    out.zero_()
    if n <= 0:
        return
    fd = open_read(root, rel)
    try:
        mv = memoryview(out.numpy())[:n]
        done = 0
        while done < n:
            got = os.preadv(fd, [mv[done:]], off + done)
            if got <= 0:
                break                       # past the end: zeros (the padding)
            done += got
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- collectives

def save(tier: Any, step: int) -> None:
    """Collective on ``tier.bg`` (the tier's background thread, after the step is committed on every node): make
    this rank's parity of ``step`` and send its stripes to the members holding them."""
    st = tier.step_storage(step)
    mine = tier._own_file(step)
    size = st.size(mine) if mine else 0
    files = tier.bg.exchange((mine or "", size), None, "memory tier (parity sizes)")
    group = parity_group(tier.nodes, tier.rank, tier.parity)
    m = len(group)
    if m < 2:
        if len(set(tier.nodes)) > 1 and not getattr(tier, "_parity_warned", False):
            tier._parity_warned = True
            warnings.warn(f"liferaft: MemoryTier(parity={tier.parity}): rank {tier.rank} has no parity group (no "
                          "other node of its group has a rank at its local position): its data is not protected "
                          "against the loss of its node; give every node the same number of ranks", stacklevel=2)
        return
    i = group.index(tier.rank)
    stripe = stripe_size([files[r][1] for r in group])
    rel = f"{step_name(step)}/{mine}" if mine else ""
    parity = torch.zeros(stripe, dtype=torch.uint8)
    step_bytes = min(PIECE, stripe)
    send_buf, recv_buf = torch.empty(step_bytes, dtype=torch.uint8), torch.empty(step_bytes, dtype=torch.uint8)
    # one round per distance d = 1..m-1: send stripe to (i + d) % m, receive from (i - d) % m (paired: no cycle)
    for d in range(1, m):
        to, frm = (i + d) % m, (i - d) % m
        s_out = stripe_in(i, to, m)                 # my stripe that member `to` keeps
        for off in range(0, stripe, step_bytes):
            n = min(step_bytes, stripe - off)
            send, recv = send_buf[:n], recv_buf[:n]
            _read_span(tier.root, rel, s_out * stripe + off, max(0, min(n, size - s_out * stripe - off)), send)
            works = [tier.bg.isend(send, group[to], 0), tier.bg.irecv(recv, group[frm], 0)]
            for w in works:
                w.wait()
            parity[off:off + n].bitwise_xor_(recv)
    header = {"format": FORMAT, "step": step, "members": group, "index": i, "stripe": stripe,
              "files": [[files[r][0], files[r][1]] for r in group]}
    tier.storage.put_atomic(_rel(step, tier.rank, "xor"), memoryview(parity.numpy()))
    tier.storage.put_atomic(_rel(step, tier.rank, "json"), json.dumps(header).encode())


def check_sizes(headers: Mapping[int, Mapping[str, Any]], missing: set[str], manifest: Mapping[str, int],
                where: str) -> None:
    """Every parity header naming a file of ``missing`` gives it the size the step's manifest records (before
    anything is allocated for a rebuild); CorruptCheckpointError naming the file otherwise."""
    for h in headers.values():
        for name, size in h["files"]:
            if name in missing and manifest.get(name) != size:
                raise CorruptCheckpointError(f"{where}: parity names {name} with {size} bytes, the manifest "
                                             f"{manifest.get(name)}: the parity is not of this save; it is not used")


def rebuild(tier: Any, step: int, headers: Mapping[int, Mapping[str, Any]], missing: set[str]) -> list[str]:
    """Collective on ``tier.coord``: rebuild every file of ``missing`` (``rebuildable`` said so, from the same
    ``headers`` on every rank) into the node of its group's lowest live member; the files this rank wrote."""
    wrote = []
    for name in sorted(missing):
        r = data_file_rank(name)
        h = next(h for h in headers.values() if r in h["members"] and h["files"][h["members"].index(r)][0] == name)
        members, stripe, files = h["members"], h["stripe"], h["files"]
        lost = members.index(r)
        live = [x for x in members if x in headers]
        builder = min(live)
        size = files[lost][1]
        me = tier.rank
        out = torch.zeros(size, dtype=torch.uint8) if me == builder else None
        for s, j, others in rebuild_plan(lost, len(members)):
            lo, hi = s * stripe, min(size, (s + 1) * stripe)
            if hi <= lo:
                continue
            parts = [(members[j], "parity", 0)] + [(members[i], files[i][0], t) for i, t in others]
            for src, what, t in parts:
                n = hi - lo
                if me == src:
                    buf = torch.empty(n, dtype=torch.uint8)
                    if what == "parity":
                        _read_span(tier.root, _rel(step, src, "xor"), 0, n, buf)
                    else:
                        fsize = files[members.index(src)][1]
                        _read_span(tier.root, f"{step_name(step)}/{what}", t * stripe,
                                   max(0, min(n, fsize - t * stripe)), buf)
                    if me == builder:
                        assert out is not None
                        out[lo:hi].bitwise_xor_(buf)
                    else:
                        tier.coord.isend(buf, builder, 1).wait()
                elif me == builder:
                    assert out is not None
                    buf = torch.empty(n, dtype=torch.uint8)
                    tier.coord.irecv(buf, src, 1).wait()
                    out[lo:hi].bitwise_xor_(buf)
        if me == builder:
            assert out is not None
            tier.storage.put_atomic(f"{step_name(step)}/{name}", memoryview(out.numpy()))
            wrote.append(name)
    return wrote


__all__ = ["FORMAT", "check_sizes", "drop", "holder_of", "parity_group", "read_header", "rebuild", "rebuild_plan", "rebuildable",
           "save", "stripe_in", "stripe_size"]
