"""The one strict JSON reader for every JSON document liferaft reads from disk (manifest, commit marker, LEASE,
PINS, STARTS; foreign headers may use it too).

``loads(data, where, ...)`` accepts exactly one UTF-8 JSON document and refuses, with CorruptCheckpointError
naming ``where`` (and ending with ``advice``):

- more than ``max_bytes`` bytes (checked before anything is decoded);
- bytes that are not UTF-8 (no BOM, no UTF-16/32 guessing);
- nesting deeper than ``max_depth``: measured by a linear scan of the brackets outside strings *before* the
  parser runs, so the parser never recurses deeply (a RecursionError is still caught, as a last resort);
- ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow a float (``1e400``);
- integer literals longer than CPython converts (4300 digits; the caller range-checks the rest);
- an object with the same key twice (``unique_keys``, the default): two readers could disagree on which wins.

It never raises another exception, whatever the bytes. Range checks of the values are the caller's.

``paused_gc()`` holds off the cyclic garbage collector while a large document is parsed and validated: parsing
creates only acyclic containers, yet a 25 MB manifest (100,000 tensors) otherwise triggers hundreds of collections
that each walk every object made so far (three quarters of the parse time).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

from liferaft.errors import CorruptCheckpointError
from liferaft.format.limits import MAX_JSON_DEPTH

__all__ = ["GC_PAUSE", "GcPause", "json_depth", "loads", "paused_gc"]

_ESCAPE = re.compile(rb"\\.", re.DOTALL)            # an escape pair: never a quote or a bracket of the structure
_STRING = re.compile(rb'"[^"]*"')                   # once escapes are gone, a string runs to the next quote
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_DEFAULT_ADVICE = "the checkpoint is damaged or not a liferaft checkpoint"


def json_depth(data: bytes) -> int:
    """The deepest bracket nesting of ``data`` outside strings, in linear time and without recursion (for any
    bytes: an invalid document gets some number, which the parser then refuses anyway)."""
    # Keep the quotes and brackets only. Dropping two adjacent quotes keeps the parity of the quotes before every
    # other byte, so whether a bracket lies in a string is unchanged: what is left are the (rare) strings that hold
    # brackets, removed in one pass over a short buffer.
    marks = (_ESCAPE.sub(b"", data) if b"\\" in data else bytes(data)).translate(None, _NOT_STRUCTURE)
    marks = marks.replace(b'""', b"")
    if b'"' in marks:
        marks = _STRING.sub(b"", marks)
    return max(accumulate(map(_STEP.__getitem__, marks)), default=0)


class GcPause:
    """The process's one pause of the cyclic garbage collector: every holder, nested or in any thread, counts in
    one count under one lock. The first hold disables the collector if it is enabled; the last drop enables it
    again if the first hold disabled it. (Holders that each saved and restored ``gc.isenabled()`` could
    interleave, one reading the state another had set, and leave the collector disabled for good.) A forked child
    starts with no holder and the collector as it was before the holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._paused = False
        self._forks = False

    def hold(self) -> None:
        with self._lock:
            if not self._forks and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._in_child)
                self._forks = True
            if self._holders == 0 and gc.isenabled():
                gc.disable()
                self._paused = True
            self._holders += 1

    def drop(self) -> None:
        with self._lock:
            if self._holders:                   # (none: a hold made before a fork dropped in the child, or a
                self._holders -= 1              # hold cut short by a signal, its disable done: enabled here)
            if self._holders == 0 and self._paused:
                self._paused = False
                gc.enable()

    def _in_child(self) -> None:
        self._lock = threading.Lock()           # (a thread that held it is not in the child)
        self._holders = 0
        if self._paused:
            self._paused = False
            gc.enable()


#: the process's one ``GcPause`` (``paused_gc`` here, ``core.process.CallGate`` for the calls of the main thread)
GC_PAUSE = GcPause()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Hold off the cyclic garbage collector in the block (``GC_PAUSE``; nothing is freed late: reference counting
    still frees every acyclic object at once)."""
    pid = os.getpid()
    GC_PAUSE.hold()
    try:
        yield
    finally:
        if os.getpid() == pid:                  # (a child forked in the block starts with no holder)
            GC_PAUSE.drop()


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number liferaft accepts")


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} overflows a float")
    return x


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))     # type: ignore[func-returns-value]
        raise ValueError(f"key {dup[:80]!r} appears twice in one object")
    return out


def loads(data: bytes | bytearray | memoryview, where: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
          unique_keys: bool = True, advice: str = _DEFAULT_ADVICE) -> Any:
    """The JSON document ``data`` (the contents of the file ``where``), strictly (see the module docstring).
    Raises CorruptCheckpointError "``where``: <what is wrong>; ``advice``" and nothing else."""
    def fail(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {msg}; {advice}")

    if len(data) > max_bytes:
        raise fail(f"{len(data)} bytes, more than the {max_bytes} a JSON file of this kind may hold")
    raw = bytes(data)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise fail(f"JSON nested {depth} levels deep, more than the {max_depth} allowed")
    try:
        with paused_gc():
            return json.loads(text, parse_constant=_constant, parse_float=_float,
                              object_pairs_hook=_unique if unique_keys else None)
    except RecursionError:
        raise fail("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:      # JSONDecodeError, and the refusals above
        raise fail(f"not valid JSON ({str(e)[:200]})") from None
