"""Tampering with a saved liferaft checkpoint, for tests of the read side (hostile-input regressions, fuzzing).

A checkpoint's ``COMMIT`` marker pins the manifest's size and xxh3_64, so a mutated manifest is refused by that
check before its parser ever sees it. These helpers write the mutation *and re-seal the marker*, so that the
mutated bytes reach ``decode_manifest`` (what an attacker who writes a whole checkpoint can do):

- ``read_manifest(path)``: the manifest as a JSON document (a dict), and its file name;
- ``rewrite_manifest(path, edit)``: ``edit(doc)`` mutates the document (or returns a new one, any JSON value;
  NaN / Infinity are written as such), then it is written back and sealed;
- ``write_manifest_bytes(path, data)``: any bytes as the manifest, sealed;
- ``reseal(path)``: recompute ``manifest_size`` / ``manifest_hash`` in ``COMMIT`` for the manifest on disk;
- ``rewrite_marker(path, edit)``: ``edit`` the marker's JSON document (no re-sealing: the marker is the seal);
- ``rewrite_step_header(file, header)``: a per-step log's record file given ``header.doc`` (as edited), its
  prologue's length and digest recomputed (checksums valid: what a writer of the node's memory can do).

Local (POSIX) checkpoints only. Nothing here checks anything: it writes what it is told.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from liferaft.codecs.checksum import digest
from liferaft.format.layout import COMMIT_MARKER

__all__ = ["read_manifest", "reseal", "rewrite_manifest", "rewrite_marker", "rewrite_step_header",
           "write_manifest_bytes"]


def _marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(os.path.join(os.fspath(path), COMMIT_MARKER), "rb") as f:
        return json.loads(f.read())


def _put(file: str, data: bytes) -> None:
    tmp = file + ".tamper"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, file)


def read_manifest(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the manifest of the checkpoint at ``path`` as parsed JSON, its file name inside the checkpoint)."""
    name = _marker(path)["manifest"]
    with open(os.path.join(os.fspath(path), name), "rb") as f:
        return json.loads(f.read()), name


def reseal(path: str | os.PathLike[str]) -> None:
    """Make ``COMMIT`` pin the manifest as it is now on disk (size and xxh3_64)."""
    marker = _marker(path)
    with open(os.path.join(os.fspath(path), marker["manifest"]), "rb") as f:
        data = f.read()
    marker["manifest_size"], marker["manifest_hash"] = len(data), digest(data)
    _put(os.path.join(os.fspath(path), COMMIT_MARKER), json.dumps(marker).encode())


def write_manifest_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the manifest of the checkpoint at ``path`` by ``data`` (any bytes) and re-seal ``COMMIT``."""
    name = _marker(path)["manifest"]
    _put(os.path.join(os.fspath(path), name), data)
    reseal(path)


def rewrite_manifest(path: str | os.PathLike[str], edit: Callable[[dict[str, Any]], Any]) -> None:
    """``edit`` the manifest's JSON document in place (or return a replacement), write it back, re-seal."""
    doc, _ = read_manifest(path)
    out = edit(doc)
    write_manifest_bytes(path, json.dumps(doc if out is None else out, separators=(",", ":")).encode())


def rewrite_marker(path: str | os.PathLike[str], edit: Callable[[dict[str, Any]], Any]) -> None:
    """``edit`` the ``COMMIT`` marker's JSON document in place (or return a replacement) and write it back."""
    marker = _marker(path)
    out = edit(marker)
    _put(os.path.join(os.fspath(path), COMMIT_MARKER), json.dumps(marker if out is None else out).encode())


def rewrite_step_header(file: str | os.PathLike[str], header: Any) -> None:
    """Write ``header.doc`` (a ``tiers.steprecord.Header`` read from ``file``, its document edited) back into the
    step record ``file`` at its header's offset, and the prologue with the new length and digest."""
    from liferaft.tiers.steprecord import encode_header, prologue

    raw = encode_header(header.doc)
    with open(file, "r+b") as f:
        f.seek(header.header_off)
        f.write(raw)
        f.seek(0)
        f.write(prologue(header.header_off + len(raw), header.header_off, len(raw), digest(raw)))
