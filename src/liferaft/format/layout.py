"""The names of the on-disk layout, in one place (docs/FORMAT.md §1): pure functions, no I/O.

One checkpoint (a storage root): ``data/<save id>/r<rank, 5 digits>.bin`` per rank (and ``...-copies.bin`` for
chunks copied from a sibling, ``...-chunks.json`` for its chunk table in format version 4), ``manifest-<save id>.json`` and the marker ``COMMIT``. A manager root (and the
memory tier): one checkpoint per step in ``step-<step, 10 digits>/``.
"""

from __future__ import annotations

COMMIT_MARKER = "COMMIT"
DATA_DIR = "data"
MANIFEST_PREFIX = "manifest-"
STEP_PREFIX = "step-"
#: A file the I/O probe (``storage.iopath``) writes and removes, left behind only by a kill -9 where the file
#: system has no unnamed files: never data, removed by cleanup.
PROBE_PREFIX = ".liferaft-probe-"


def manifest_name(save_id: str) -> str:
    """The manifest of save ``save_id``."""
    return f"{MANIFEST_PREFIX}{save_id}.json"


def data_prefix(save_id: str) -> str:
    """The folder (with its trailing ``/``) holding the data files of save ``save_id``."""
    return f"{DATA_DIR}/{save_id}/"


def data_file_name(save_id: str, rank: int) -> str:
    """The data file rank ``rank`` writes for save ``save_id``."""
    return f"{data_prefix(save_id)}r{rank:05d}.bin"


def copies_file_name(save_id: str, rank: int) -> str:
    """The file of chunks rank ``rank`` copied from a sibling checkpoint into save ``save_id``."""
    return f"{data_prefix(save_id)}r{rank:05d}-copies.bin"


def table_file_name(save_id: str, rank: int) -> str:
    """The chunk table rank ``rank`` writes for save ``save_id`` (format version 4, docs/FORMAT.md §4.6): the
    records of the chunks of its data file."""
    return f"{data_prefix(save_id)}r{rank:05d}-chunks.json"


def data_file_rank(name: str) -> int | None:
    """The rank that wrote data file ``name`` (``data/<id>/r00003.bin`` → 3); None for any other name."""
    first, _, rest = name.partition("/")
    base = rest.rpartition("/")[2]
    digits = base[1:-4]
    if first != DATA_DIR or "/" not in rest or not (base.startswith("r") and base.endswith(".bin")):
        return None
    return int(digits) if digits.isdigit() and digits.isascii() else None


def is_layout_name(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint root) is one of liferaft's own files or folders: data, a
    manifest, the marker (or its temporary copy)."""
    first, _, rest = name.partition("/")
    return (first == DATA_DIR and bool(rest)) or first.startswith(COMMIT_MARKER) or \
        (first.startswith(MANIFEST_PREFIX) and ".json" in first) or is_probe_name(name)


def is_probe_name(name: str) -> bool:
    """Whether the last part of ``name`` is a file of the I/O probe (``PROBE_PREFIX``...): never data."""
    return name.rpartition("/")[2].startswith(PROBE_PREFIX)


def is_stale(name: str, keep: str) -> bool:
    """Whether ``name`` is a file of a save other than ``keep`` (or a temporary file) once ``keep`` committed."""
    base = name.rsplit("/", 1)[-1]
    if name.startswith(DATA_DIR + "/"):
        return not name.startswith(data_prefix(keep))
    if name.startswith(MANIFEST_PREFIX):
        return name != manifest_name(keep)
    return ".tmp-" in base or is_probe_name(name)


def step_name(step: int) -> str:
    """The folder of step ``step`` under a manager root or the memory tier."""
    return f"{STEP_PREFIX}{step:010d}"


def parse_step(name: str) -> int | None:
    """The step of a name whose first component is a step folder (``step-0000000012/...`` → 12); else None. Only
    the canonical name ``step_name(n)`` is step ``n`` (``step-5``, ``step-00000000005``: not steps), so that
    listing, restoring and deleting a step all mean the same folder: the one rule for every reader of a root."""
    step = step_like(name)
    return step if step is not None and name.split("/", 1)[0] == step_name(step) else None


def step_like(name: str) -> int | None:
    """The number a first component ``step-<digits>`` claims, canonical or not (``step-10``, torchtitan's DCP
    folders): for listing such folders as what they are, never for restoring or deleting them (``parse_step``)."""
    head = name.split("/", 1)[0]
    digits = head[len(STEP_PREFIX):]
    if head.startswith(STEP_PREFIX) and digits.isdigit() and digits.isascii() and len(digits) <= 4300:
        return int(digits)
    return None
