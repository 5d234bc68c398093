"""What a node holds of the per-step log, as one rank sees it at a recovery (``tiers.steplog.StepLog.recover``).

The ring's files: ``rank_dir(r)/slot_name`` per rank; a rank's own records and the replicas its node keeps of
ranks on other nodes. ``list_node`` reads them once: its own records whole and verified (a damaged copy is no
copy: a peer's may serve), the replicas by their checked header (verified whole by the rank they are sent to),
records of another manager refused (``foreign``). A replica with a held trailer (``steprecord.held_trailer``:
its gradients left to the holder's own record of that step) counts only if that record is on this node, in the
slot the trailer names, with the runs inside it (``home_of``); it is filled from there when it is sent, or, in
this rank's own folder, filled and verified here. Nothing here talks to other ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from liferaft.errors import LiferaftError
from liferaft.storage.files import open_folder
from liferaft.tiers.stepplan import verify_record
from liferaft.tiers.steprecord import Header, Held, fill_held, held_home, read_header, read_held, read_record

Kept = dict[int, tuple[Header, bytearray, str]]      # step -> this rank's own record: header, bytes, path
_SLOT = re.compile(r"slot-([0-9]{4,})", re.ASCII)      # a slot file's name (``slot_name``)


def rank_dir(rank: int) -> str:
    return f"r{rank:05d}"


def slot_name(rank: int, slot: int) -> str:
    return f"{rank_dir(rank)}/slot-{slot:04d}"


def own_slots(root: str, rank: int) -> list[int]:
    """The slots whose files are in ``rank``'s ring folder (names exactly as ``slot_name`` makes them; any other
    file there is not a slot)."""
    try:
        names = os.listdir(os.path.join(root, rank_dir(rank)))
    except OSError:
        return []
    found = ((name, _SLOT.fullmatch(name)) for name in names)
    return [int(m[1]) for name, m in found if m and slot_name(rank, int(m[1])).endswith("/" + name)]


def records_after(root: str, rank: int, step: int) -> dict[int, int]:
    """{slot: step} of ``rank``'s records newer than ``step`` in its ring (headers only, checked: a damaged one
    is no record)."""
    out: dict[int, int] = {}
    for s in own_slots(root, rank):
        try:
            h = read_header(root, slot_name(rank, s))
        except (LiferaftError, OSError):
            h = None
        if h is not None and h.step > step:
            out[s] = h.step
    return out


def remove_after(root: str, step: int) -> None:
    """Remove every record newer than ``step`` in the node's folders under ``root`` (own and replicas; headers
    checked: a file that is no record stays). A folder is opened without following a link, and its files are
    read and removed through that descriptor: nothing outside ``root`` is read or removed, whatever is swapped in."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for d in names:
        try:
            at = open_folder(root, [d])
        except (LiferaftError, OSError):
            continue                        # a link, a file: not a ring folder
        try:
            for name in os.listdir(at):
                try:
                    h = read_header(root, f"{d}/{name}", folder=at)
                except (LiferaftError, OSError):
                    h = None
                if h is not None and h.step > step:
                    os.unlink(name, dir_fd=at)
        finally:
            os.close(at)


@dataclass
class Listing:
    """``records``: (rank, step) → (slot name, length, world) of the records newer than the full checkpoint this
    node holds, as this rank sees them, and (-1, i) → (why, 0, -1) for each refused file; ``slots``: this rank's
    own slot → the step it holds; ``thin``: replica slot name → its held trailer, for those this rank sends."""

    records: dict[tuple[int, int], tuple[str, int, int]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)
    thin: dict[str, Held] = field(default_factory=dict)


def list_node(root: str, nodes: list[str], rank: int, world: int, owner: str, full: int, kept: Kept,
              live: Callable[[int, int], bool] = lambda step, epoch: True) -> Listing:
    """The records newer than ``full`` under ``root`` that ``rank`` lists (its own, and the replicas of ranks on
    other nodes; other ranks of this node list their own): see ``Listing``. ``rank``'s own records are read whole
    and verified, their bytes set aside in ``kept[step]`` for the replay."""
    out = Listing()
    thin: list[tuple[Header, str, Held, bool]] = []
    if not os.path.isdir(root):
        return out
    node = nodes[rank]
    first = min(r for r, m in enumerate(nodes) if m == node) == rank
    for d in sorted(os.listdir(root)):
        folder = os.path.join(root, d)
        if not d.startswith("r") or not os.path.isdir(folder):
            continue
        own = d == rank_dir(rank)
        if not own and any(d == rank_dir(r) for r in range(world) if nodes[r] == node):
            continue
        for name in sorted(os.listdir(folder)):
            rel = f"{d}/{name}"
            try:
                h = read_header(root, rel)
                if h is None or h.step <= full or d != rank_dir(h.doc["rank"]):
                    continue
                held = read_held(root, rel, h.length)
                if held is not None:        # (its own folder's too: ranks placed on other nodes at a restart)
                    if own or first:        # (one rank per node lists the others' held replicas)
                        thin.append((h, rel, held, own))
                    continue
                if own:
                    data = read_record(root, rel, h.length)
                    verify_record(h, data)
            except (LiferaftError, OSError) as e:
                out.records[(-1, len(out.records))] = (f"refused: {e}", 0, -1)      # reported with the outcome
                continue
            if foreign(h, owner, out.records) or not live(h.step, record_epoch(h)):
                continue                    # (not live: a record of a run the root rolled back from)
            out.records[(h.doc["rank"], h.step)] = (rel, h.length, h.doc["world"])
            if own and h.doc["rank"] == rank:
                out.slots[int(name.split("-")[1])] = h.step
                kept[h.step] = (h, data, os.path.join(root, rel))
    for h, rel, held, own in thin:
        try:
            if foreign(h, owner, out.records) or held.step != h.step or held.source != h.doc["rank"] \
                    or not live(h.step, record_epoch(h)):
                continue
            home = home_of(root, rank, held, kept)     # (checked: the runs inside it; None: not on this node)
            if home is None:
                continue
            if own:
                data = read_record(root, rel, h.length)
                fill_held(data, held, home, os.path.join(root, rel))
                verify_record(h, data)
                out.slots[int(rel.rsplit("-", 1)[1])] = h.step
                kept[h.step] = (h, data, os.path.join(root, rel))
            else:
                out.thin[rel] = held
            out.records[(h.doc["rank"], h.step)] = (rel, h.length, h.doc["world"])
        except (LiferaftError, OSError) as e:
            out.records[(-1, len(out.records))] = (f"refused: {os.path.join(root, rel)} (a replica): {e}", 0, -1)
    return out


def record_epoch(h: Header) -> int:
    """The manager's rollbacks before the record was written (its header's ``epoch``; 0: none recorded)."""
    e = h.doc.get("epoch")
    return e if type(e) is int and e >= 0 else 0


def foreign(h: Header, owner: str, records: dict[tuple[int, int], tuple[str, int, int]]) -> bool:
    """Whether ``h`` is a record of another manager's log (then noted in ``records`` as refused)."""
    if h.doc.get("owner") == owner:
        return False
    other = str(h.doc.get("owner"))[:20]
    why = f"refused: {h.path}: written by another manager (owner {other!r}, this one is {owner!r})"
    records[(-1, len(records))] = (why, 0, -1)
    return True


def home_of(root: str, rank: int, held: Held, kept: Kept) -> bytearray | None:
    """``steprecord.held_home`` of ``held`` on this node (``rank``'s own record, verified, if it is the holder)."""
    rel = slot_name(held.holder, held.own_slot)
    mine = kept.get(held.step) if held.holder == rank else None
    return held_home(root, rel, held, mine[1] if mine and mine[2].endswith(rel) else None)
