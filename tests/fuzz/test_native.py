"""liferaft's own checkpoints, damaged: the manifest (JSON-tree mutations and byte edits, re-sealed in the
``COMMIT`` marker so they reach the parser — or not, so the marker's checksum must catch them), the marker itself
and the data files (frame headers and declared sizes of zstd and q8 chunks, raw chunks)."""

from __future__ import annotations

import json
import os

from hypothesis import given
from hypothesis import strategies as st
from mutations import dumps, mutate_bytes, mutate_tree, with_secret
from props import Workspace

from liferaft.testing.tamper import read_manifest, write_manifest_bytes

NATIVE = ["native", "native", "native-base", "perrank"]
#: chunk fields every byte of which the block hashes bind: damage there must be caught (strict)
BOUND = {"file", "byte_offset", "length", "block_size", "hashes", "codec", "frames"}


def _strict(at: tuple) -> bool:
    if at[:1] == ("files",):
        return True
    return len(at) >= 5 and at[0] == "tensors" and at[2] == "chunks" and at[4] in BOUND and \
        not (len(at) == 5 and at[4] == "codec")        # dropping or renaming a codec changes the meaning


@given(st.data())
def test_manifest_structure(seeds, call_timeout, data):
    seed = seeds[data.draw(st.sampled_from(NATIVE), label="seed")]
    with Workspace(seed, call_timeout) as w:
        tree, _ = read_manifest(w.src)
        new, at, op = mutate_tree(data, tree, "manifest")
        write_manifest_bytes(w.src, with_secret(dumps(new, data), w.secret))
        w.run(data, strict=_strict(at) and op == "replace")


@given(st.data())
def test_manifest_bytes(seeds, call_timeout, data):
    seed = seeds[data.draw(st.sampled_from(NATIVE), label="seed")]
    with Workspace(seed, call_timeout) as w:
        path = os.path.join(w.src, read_manifest(w.src)[1])
        with open(path, "rb") as f:
            blob = f.read()
        sealed = data.draw(st.booleans(), label="re-sealed")
        blob = mutate_bytes(data, blob, label="manifest")
        if sealed:
            write_manifest_bytes(w.src, blob)
        else:
            with open(path, "wb") as f:
                f.write(blob)
        w.run(data, strict=not sealed)


@given(st.data())
def test_commit_marker(seeds, call_timeout, data):
    seed = seeds[data.draw(st.sampled_from(NATIVE), label="seed")]
    with Workspace(seed, call_timeout) as w:
        marker = os.path.join(w.src, "COMMIT")
        with open(marker, "rb") as f:
            blob = f.read()
        if data.draw(st.booleans(), label="structural"):
            new, at, _ = mutate_tree(data, json.loads(blob), "marker")
            blob, strict = with_secret(dumps(new, data), w.secret), at[:1] != ("version",)
        else:
            blob, strict = mutate_bytes(data, blob, label="marker"), True
        with open(marker, "wb") as f:
            f.write(blob)
        w.run(data, strict=strict)


@given(st.data())
def test_data_frames(seeds, call_timeout, data):
    """Bytes of the data files (the block hashes are of the decoded bytes, so a damaged zstd or q8 frame reaches
    its decoder): frame headers of encoded chunks, raw chunks, anywhere; every change must be caught."""
    seed = seeds[data.draw(st.sampled_from(NATIVE), label="seed")]
    with Workspace(seed, call_timeout) as w:
        manifest, _ = read_manifest(w.src)
        chunks = [c for t in manifest["tensors"] for c in t["chunks"]]
        chunk = data.draw(st.sampled_from(chunks), label="chunk")
        file = os.path.normpath(os.path.join(w.src, chunk["file"]))
        with open(file, "rb") as f:
            blob = f.read()
        start = chunk["byte_offset"]
        sizes = chunk.get("frames") or [chunk["length"]]
        where = data.draw(st.sampled_from(["header", "frame", "anywhere"]), label="where")
        if where == "header":
            k = data.draw(st.integers(0, len(sizes) - 1))
            at = start + sum(sizes[:k])
            focus = (at, at + min(32, sizes[k]))
        elif where == "frame":
            focus = (start, start + sum(sizes))
        else:
            focus = None
        with open(file, "wb") as f:
            f.write(mutate_bytes(data, blob, focus, label="data"))
        w.run(data, strict=True)
