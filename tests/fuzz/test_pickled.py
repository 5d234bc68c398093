"""Pickled foreign inputs, damaged: DCP's ``.metadata`` (torch's own Metadata dataclasses with a field replaced,
re-pickled; byte edits; planted pickles) and ``torch.save`` archives (a zip member's bytes, the ``data.pkl``
opcodes, a planted pickle, a legacy raw pickle, the file's bytes). A planted pickle names the canary
(``fuzz_canary.fire``) or ``os.system`` touching the canary's marker file: neither may ever run. No checksums
bind these formats' tensor bytes, so a changed value may load (relaxed)."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile

import fuzz_canary
import torch
from hypothesis import given
from hypothesis import strategies as st
from mutations import mutate_bytes
from props import Workspace


def planted() -> list[bytes]:
    """Pickles that run code when unpickled by an unrestricted unpickler."""
    touch = f"touch {fuzz_canary.MARKER}".encode()
    return [b"cfuzz_canary\nfire\n(S'pickle'\ntR.",
            b"cposix\nsystem\n(S'" + touch + b"'\ntR.",
            b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x0bfuzz_canary\x8c\x04fire\x93)R.",
            b"cbuiltins\neval\n(S'__import__(\"fuzz_canary\").fire(\"eval\")'\ntR.",
            b"ctorch.distributed.checkpoint.metadata\nMetadata\n(cfuzz_canary\nfire\n)RtR."]


HOSTILE = [-1, 0, 2**31, 2**62, 2**63, 10**30, None, float("nan"), "", "../../secret/secret.bin", "$SECRET",
           "/etc/passwd", "__0_0.distcp/../../x", torch.Size([2**62]), torch.Size([]), torch.Size([-1, 3]),
           torch.Size([0]), torch.float64, torch.int8, [], {}, (1, 2), "model.w", torch.sparse_coo]


def _slots(obj: object, depth: int = 0) -> list[tuple[object, object]]:
    """(container, key/field/index) of every value inside a Metadata object graph."""
    out: list[tuple[object, object]] = []
    if depth > 8:
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.append((obj, f.name))
            out += _slots(getattr(obj, f.name), depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            out += _slots(k, depth + 1) + _slots(v, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            out += _slots(v, depth + 1)
    return out


def _set(container: object, key: object, value: object) -> None:
    if isinstance(container, (dict, list)):
        container[key] = value  # type: ignore[index]
    else:
        object.__setattr__(container, str(key), value)


@given(st.data())
def test_dcp_metadata(seeds, call_timeout, data):
    with Workspace(seeds["dcp"], call_timeout) as w:
        path = os.path.join(w.src, ".metadata")
        with open(path, "rb") as f:
            blob = f.read()
        how = data.draw(st.sampled_from(["object", "object", "bytes", "planted", "shard"]), label="how")
        if how == "object":
            meta = pickle.loads(blob)            # our own seed, written by liferaft's DCP writer
            for _ in range(data.draw(st.integers(1, 2), label="fields")):
                container, key = data.draw(st.sampled_from(_slots(meta)), label="slot")
                value = data.draw(st.sampled_from(HOSTILE), label="value")
                _set(container, key, w.secret if value == "$SECRET" else value)
            blob = pickle.dumps(meta)
        elif how == "bytes":
            blob = mutate_bytes(data, blob, label="metadata")
        elif how == "planted":
            blob = data.draw(st.sampled_from(planted()), label="pickle")
        else:                                     # the data file instead (no checksums: relaxed)
            path = os.path.join(w.src, "__0_0.distcp")
            with open(path, "rb") as f:
                blob = mutate_bytes(data, f.read(), label="shard")
        with open(path, "wb") as f:
            f.write(blob)
        w.run(data, strict=False)


def _rezip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, b in members.items():
            z.writestr(name, b)
    return buf.getvalue()


@given(st.data())
def test_torch_archive(seeds, call_timeout, data):
    with Workspace(seeds["torch"], call_timeout) as w:
        with open(w.src, "rb") as f:
            blob = f.read()
        how = data.draw(st.sampled_from(["member", "pickle", "planted", "legacy", "bytes", "truncated"]),
                        label="how")
        if how in ("member", "pickle", "planted"):
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                members = {n: z.read(n) for n in z.namelist()}
            pkl = next(n for n in members if n.endswith("data.pkl"))
            name = pkl if how != "member" else data.draw(st.sampled_from(sorted(members)), label="member")
            if how == "planted":
                members[name] = data.draw(st.sampled_from(planted()), label="pickle")
            else:
                members[name] = mutate_bytes(data, members[name], label=name)
            blob = _rezip(members)
        elif how == "legacy":
            blob = data.draw(st.sampled_from(planted()), label="pickle")
        elif how == "bytes":
            blob = mutate_bytes(data, blob, label="file")
        else:
            blob = blob[:data.draw(st.integers(0, len(blob) - 1), label="length")]
        with open(w.src, "wb") as f:
            f.write(blob)
        w.run(data, strict=False)
