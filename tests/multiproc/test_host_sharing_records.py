"""Same-host shared reads key what they share by the whole decode identity, not by the stored bytes alone: two
chunk records may name the same (file, offset, length) yet decode it differently (a delta base, other hashes).
Each tensor must end up exactly as if read alone (regression: the receivers copied the reader's verified bytes
of the *other* record into theirs, unchecked against their own)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from multiproc import _host_alias_ranks as A

import liferaft
from liferaft import SaveOptions
from liferaft.codecs.checksum import block_hashes
from liferaft.codecs.frames import decode_frames
from liferaft.core.chunks import shm
from liferaft.testing import run_ranks
from liferaft.testing.tamper import rewrite_manifest

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def _aliased(path: str, delta: bool) -> None:
    """Save w, x, y; give y a chunk record naming x's stored bytes: with ``delta``, XOR'd with w's chunk (hashes
    right for x ^ w: a valid record); without, x's record with the hashes of other bytes (a corrupt one)."""
    x, w = A.tensors()
    liferaft.save(path, {"w": w, "x": x, "y": torch.zeros(A.N)}, options=SaveOptions(compression="on"))

    def edit(doc):
        t = {t["key"]: t for t in doc["tensors"]}
        (cx,), (cw,) = t["x"]["chunks"], t["w"]["chunks"]
        assert cx.get("codec")
        with open(os.path.join(path, cx["file"]), "rb") as f:
            f.seek(cx["byte_offset"])
            stored = f.read(sum(cx["frames"]))
        raw = bytearray(cx["length"])
        decode_frames(memoryview(stored), cx["frames"], cx["codec"], memoryview(raw), cx["block_size"], "float32",
                      "x")
        base = np.frombuffer(w.numpy().tobytes(), dtype=np.uint8)
        y = np.bitwise_xor(np.frombuffer(bytes(raw), dtype=np.uint8), base)
        cy = copy.deepcopy(cx)
        if delta:
            cy["delta"] = {k: v for k, v in cw.items() if k != "checksum"}
        cy["hashes"] = block_hashes(memoryview(y.tobytes()), cx["block_size"], doc["checksum"])
        t["y"]["chunks"] = [cy]
    rewrite_manifest(path, edit)


def test_a_record_sharing_stored_bytes_with_another_loads_as_if_read_alone(tmp_path):
    path = str(tmp_path / "ck")
    _aliased(path, delta=True)
    for share in (False, True):
        out = run_ranks(A.load, 2, path, share, timeout=240.0, pg_timeout=60.0)
        assert all(isinstance(o, dict) and o["x"] and o["w"] and o["y==x^w"] for o in out), (share, out)
    assert any(o["received"] > 0 for o in out), f"nothing was shared: {out}"


def test_a_record_whose_hashes_do_not_match_is_refused_even_when_its_bytes_are_shared(tmp_path):
    path = str(tmp_path / "ck")
    _aliased(path, delta=False)
    for share in (False, True):
        out = run_ranks(A.load, 2, path, share, timeout=240.0, pg_timeout=60.0)
        assert out == ["CorruptCheckpointError"] * 2, (share, out)
