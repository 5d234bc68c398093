"""safetensors inputs, damaged: the header as JSON (structural, the length prefix fixed so the change reaches the
parser), the file's bytes, and a sharded folder's ``model.safetensors.index.json``. safetensors carries no
checksums, so changed tensor bytes may load (relaxed); a header this test finds invalid (out of bounds,
overlapping, sizes not dtype x shape) must be refused."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

from hypothesis import given
from hypothesis import strategies as st
from mutations import dumps, mutate_bytes, mutate_tree, with_secret
from props import Workspace

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def header_problem(blob: bytes) -> str | None:
    """Why the safetensors file ``blob`` is invalid (as this test reads the format), or None."""
    if len(blob) < 8:
        return "shorter than its length prefix"
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        return "header longer than the file"
    try:
        header = json.loads(blob[8:8 + n])
    except (ValueError, RecursionError):
        return "header is not JSON"
    if not isinstance(header, dict):
        return "header is not an object"
    size, spans = len(blob) - 8 - n, []
    for k, e in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str):
            return f"entry {k!r} malformed"
        if e["dtype"] not in SIZES:
            return None              # a dtype this test does not know: no judgement
        shape, off = e.get("shape"), e.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return f"entry {k!r}: bad shape"
        if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off)):
            return f"entry {k!r}: bad data_offsets"
        b, end = off
        if not 0 <= b <= end <= size or end - b != math.prod(shape) * SIZES[e["dtype"]]:
            return f"entry {k!r}: data_offsets {off} out of bounds or not dtype x shape"
        spans.append((b, end))
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return "overlapping data_offsets"
    return None


def _pick_file(w: Workspace, data: st.DataObject) -> str:
    if os.path.isfile(w.src):
        return w.src
    return os.path.join(w.src, data.draw(st.sampled_from(sorted(
        f for f in os.listdir(w.src) if f.endswith(".safetensors"))), label="shard"))


@given(st.data())
def test_safetensors_header(seeds, call_timeout, data):
    with Workspace(seeds[data.draw(st.sampled_from(["st-file", "st-dir"]), label="seed")], call_timeout) as w:
        file = _pick_file(w, data)
        with open(file, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        new, _, _ = mutate_tree(data, header, "header")
        text = with_secret(dumps(new, data), w.secret)
        blob = struct.pack("<Q", len(text)) + text + blob[8 + n:]
        with open(file, "wb") as f:
            f.write(blob)
        w.run(data, strict=False, refuse=header_problem(blob))


@given(st.data())
def test_safetensors_bytes(seeds, call_timeout, data):
    with Workspace(seeds[data.draw(st.sampled_from(["st-file", "st-dir"]), label="seed")], call_timeout) as w:
        file = _pick_file(w, data)
        with open(file, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        focus = data.draw(st.sampled_from([(0, 8), (8, 8 + n), None]), label="focus")
        if focus == (0, 8) and data.draw(st.booleans(), label="huge length"):
            blob = struct.pack("<Q", data.draw(st.sampled_from([2**62, 2**63, 2**64 - 1, n + 1, 0]))) + blob[8:]
        else:
            blob = mutate_bytes(data, blob, focus, label="file")
        with open(file, "wb") as f:
            f.write(blob)
        w.run(data, strict=False, refuse=header_problem(blob))


@given(st.data())
def test_safetensors_index(seeds, call_timeout, data):
    """The index of a sharded folder: a weight_map naming a file outside the folder (a valid safetensors file lies
    there, so following it would succeed: the audit hook must see no open of it), damaged JSON."""
    with Workspace(seeds["st-dir"], call_timeout) as w:
        index = os.path.join(w.src, "model.safetensors.index.json")
        shards = sorted(f for f in os.listdir(w.src) if f.endswith(".safetensors"))
        w.secret = os.path.join(os.path.dirname(w.secret), "other.safetensors")
        shutil.copy(os.path.join(w.src, shards[0]), w.secret)
        with open(index, "rb") as f:
            blob = f.read()
        if data.draw(st.booleans(), label="structural"):
            tree = json.loads(blob)
            if data.draw(st.booleans(), label="weight_map value"):
                key = data.draw(st.sampled_from(sorted(tree["weight_map"])), label="key")
                tree["weight_map"][key] = data.draw(st.sampled_from(
                    ["$SECRET", "../../secret/other.safetensors", "../m/" + shards[0], "/etc/passwd", shards[-1],
                     "missing.safetensors", "", ".", "model.safetensors.index.json", 7, None]), label="file")
            else:
                tree, _, _ = mutate_tree(data, tree, "index")
            blob = with_secret(dumps(tree, data), w.secret)
        else:
            blob = mutate_bytes(data, blob, label="index")
        with open(index, "wb") as f:
            f.write(blob)
        w.run(data, strict=False)
