"""The names of the on-disk layout, in one place (docs/FORMAT.md §1): pure functions, no I/O.

One checkpoint (a storage root): ``data/<save id>/r<rank, 5 digits>.bin`` per rank (and ``...-copies.bin`` for
chunks copied from a sibling, ``...-chunks.json`` for its chunk table in format version 4), ``manifest-<save id>.json`` and the marker ``COMMIT``. A manager root (and the
memory tier): one checkpoint per step in ``step-<step, 10 digits>/``.
"""

from __future__ import annotations

import re

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
    """Whether ``name`` (relative to a checkpoint root) is one of liferaft's own files, by its exact name: a data
    file, a manifest, the marker, their temporaries, the I/O probe's files (``is_stale``)."""
    return name == COMMIT_MARKER or is_stale(name, "") or _DATA_FILE.fullmatch(name) is not None or \
        _MANIFEST_FILE.fullmatch(name) is not None


def is_probe_name(name: str) -> bool:
    """Whether the last part of ``name`` is a file of the I/O probe (``PROBE_PREFIX``...): never data."""
    return name.rpartition("/")[2].startswith(PROBE_PREFIX)


_ID = r"[0-9a-f]{16}"
_TMP = r"(\.tmp-[0-9a-f]{12})?"
#: liferaft's own files of one save, exactly (group 1: the save id; group 3 or 2: a temporary file's suffix)
_DATA_FILE = re.compile(rf"{DATA_DIR}/({_ID})/r\d{{5,}}(?:\.bin|-copies\.bin|-chunks\.json){_TMP}")
_MANIFEST_FILE = re.compile(rf"{MANIFEST_PREFIX}({_ID})\.json{_TMP}")
_COMMIT_TMP = re.compile(rf"{COMMIT_MARKER}\.tmp-[0-9a-f]{{12}}")


def is_stale(name: str, keep: str) -> bool:
    """Whether ``name`` is a file of a save other than ``keep`` (or a temporary file of liferaft's) once ``keep``
    committed. Only liferaft's exact names (``data/<16 hex>/r<rank>.bin``, ``-copies.bin``, ``-chunks.json``,
    ``manifest-<16 hex>.json``, their and ``COMMIT``'s ``.tmp-<12 hex>`` temporaries, the I/O probe's files):
    a user's file in the folder (``data/train.csv``, ``notes.tmp-draft``) is never one, whatever it is called."""
    for pattern in (_DATA_FILE, _MANIFEST_FILE):
        m = pattern.fullmatch(name)
        if m is not None:
            return m.group(1) != keep or m.group(2) is not None
    return _COMMIT_TMP.fullmatch(name) is not None or is_probe_name(name)


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
    folders): for listing such folders as what they are, never for restoring or deleting them (``parse_step``).
    A number of 2**63 or more is no step (``maybe_save``, ``restore(step=)`` and ``pin`` take none): None."""
    head = name.split("/", 1)[0]
    digits = head[len(STEP_PREFIX):]
    significant = digits.lstrip("0")
    if head.startswith(STEP_PREFIX) and digits.isdigit() and digits.isascii() and len(significant) <= 19:
        step = int(significant or "0")          # (never more digits than int() takes, however many zeros lead)
        return step if step <= _MAX_STEP else None     # (a step every API takes: [0, 2**63))
    return None


_MAX_STEP = 2 ** 63 - 1
