"""The canary planted pickles call: if it ever runs, a checkpoint executed code. It records the call in this
process and, for pickles run in another process, in the file ``MARKER`` (``os.system`` canaries touch it too)."""

from __future__ import annotations

import os
import tempfile

MARKER = os.path.join(tempfile.gettempdir(), f"liferaft-fuzz-canary-{os.getpid()}")
_CALLS: list[str] = []


def fire(*args: object) -> str:
    """What a planted pickle's GLOBAL names: record that code ran."""
    _CALLS.append(repr(args)[:100])
    with open(MARKER, "w") as f:
        f.write("fired")
    return "fired"


def fired() -> bool:
    return bool(_CALLS) or os.path.exists(MARKER)


def what() -> str:
    return ", ".join(_CALLS) or f"{MARKER} written"


def reset() -> None:
    _CALLS.clear()
    if os.path.exists(MARKER):
        os.unlink(MARKER)
