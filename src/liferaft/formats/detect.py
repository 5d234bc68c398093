"""What a path holds: the one detector of formats every entry point uses (load, read, inspect, verify, diff,
convert, the CLI). ``detect(path)``: "liferaft" (a ``COMMIT`` marker, an unfinished liferaft save, or any URL),
"dcp" (a folder with ``.metadata``), "safetensors" (a ``.safetensors`` file, a folder with ``model.safetensors`` or
its index) or "torch" (any other file: a ``torch.save`` archive). ``sniff`` is the same without raising;
``detect_names`` decides from a folder's listing (a manager root's step folders, an object store)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal

from liferaft.errors import CheckpointNotFoundError, StateMismatchError
from liferaft.format.layout import COMMIT_MARKER, DATA_DIR, MANIFEST_PREFIX

Format = Literal["liferaft", "dcp", "safetensors", "torch"]
FORMATS: tuple[Format, ...] = ("liferaft", "dcp", "safetensors", "torch")
INDEX = "model.safetensors.index.json"
#: How messages name each format.
NAMES = {"liferaft": "liferaft checkpoint", "dcp": "DCP checkpoint", "safetensors": "safetensors checkpoint",
         "torch": "torch.save file"}


def detect_names(names: Iterable[str]) -> Format | None:
    """The format of a folder from the names of the files in it (relative, ``/``-separated; nested ones too):
    None when they show none."""
    top = {n.split("/", 1)[0] for n in names}
    if COMMIT_MARKER in top or DATA_DIR in top or any(n.startswith(MANIFEST_PREFIX) for n in top):
        return "liferaft"                   # an unfinished or damaged one too: liferaft's reader says what is wrong
    if ".metadata" in top:
        return "dcp"
    if "model.safetensors" in top or INDEX in top:
        return "safetensors"
    return None


def sniff(path: Any) -> Format | None:
    """``detect`` without raising: None for a path that does not exist or holds nothing recognizable."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = os.fspath(path)
    if "://" in p:
        return "liferaft"
    if os.path.isfile(p):
        return "safetensors" if p.endswith(".safetensors") else "torch"
    if not os.path.isdir(p):
        return None
    names = os.listdir(p)
    if DATA_DIR in names and not os.path.isdir(os.path.join(p, DATA_DIR)):
        names.remove(DATA_DIR)
    return detect_names(names)


def detect(path: str | os.PathLike[str]) -> Format:
    """What ``path`` holds (one of ``FORMATS``); raises CheckpointNotFoundError when the path does not exist and
    StateMismatchError when nothing there is recognizable."""
    fmt = sniff(path)
    if fmt is not None:
        return fmt
    p = os.fspath(path)
    if not os.path.exists(p):
        raise CheckpointNotFoundError(f"{p}: no checkpoint there (the path does not exist)")
    raise StateMismatchError(f"{p}: not a liferaft checkpoint, DCP checkpoint, safetensors folder or torch.save "
                             "file (nothing recognizable there); pass the format explicitly")


