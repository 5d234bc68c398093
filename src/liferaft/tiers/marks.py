"""The newest step a manager began to save beyond the memory tier, kept in each node's memory-tier folder.

A restore takes the memory tier's newest complete step without listing the root or the remote tier when that step
is at least as new as this mark: every save this manager starts to its root (or drains to a slower tier) writes
the mark first, so no slower tier can hold a newer committed step of it. Without a mark (fresh nodes, a mark
damaged or of another root) the restore lists the slower tiers as before: a mark only ever saves a listing, it
never makes a restore pick a step it would not pick after listing — except one older than a newer step someone
else wrote under the root (another writer than the manager: the lease keeps other jobs out).

One small JSON file per manager root in the node's folder: ``MARK-<sha1 of the root's URL, 16 hex>.json`` holding
``{"format": 1, "owner": <root URL>, "step": <int>}``. Written by the node's leader (``put_atomic``, so a reader sees
the old or the new one); read by every rank as hostile bytes: a regular file (no link followed, no FIFO opened
for good), at most ``MAX_MARK_BYTES``, strict JSON, the owner the caller's, the step an integer in range —
anything else is no mark.
"""

from __future__ import annotations

import hashlib
import json
import os

from liferaft.errors import LiferaftError
from liferaft.format.jsonsafe import loads
from liferaft.format.limits import MAX_INT
from liferaft.storage.files import open_read
from liferaft.storage.posix import PosixStorage

FORMAT = 1
MAX_MARK_BYTES = 64 << 10


def mark_name(owner: str) -> str:
    """The file name of ``owner``'s mark in a node folder (owner: the manager root's URL)."""
    return f"MARK-{hashlib.sha1(owner.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}.json"


def read_mark(node_root: str, owner: str) -> int | None:
    """The step ``owner``'s mark in the node folder ``node_root`` holds; None if there is none or it does not hold
    (any reason: a mark is a hint, never an error)."""
    name = mark_name(owner)
    try:
        fd = open_read(node_root, name, limit=MAX_MARK_BYTES)
        with os.fdopen(fd, "rb") as f:
            doc = loads(f.read(MAX_MARK_BYTES + 1), os.path.join(node_root, name), MAX_MARK_BYTES)
    except (OSError, LiferaftError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("owner") != owner:
        return None
    step = doc.get("step")
    return step if type(step) is int and 0 <= step <= MAX_INT else None


def write_mark(storage: PosixStorage, owner: str, step: int) -> None:
    """Raise ``owner``'s mark in the node folder of ``storage`` to ``step`` (never lower it: a restore of an older
    step that then saves leaves the newer steps under the root, and a later restore must still list them)."""
    held = read_mark(storage.root, owner)
    if held is not None and held >= step:
        return
    doc = {"format": FORMAT, "owner": owner, "step": int(step)}
    storage.put_atomic(mark_name(owner), json.dumps(doc).encode())
