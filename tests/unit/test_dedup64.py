"""Equality of data is never decided on fewer than 64 bits (docs/FORMAT.md §3.1, §4.2).

Block checksums are CRC-32C (32 bits, and linear: a change inside one block can be completed by four chosen bytes
so that the block's CRC stays the same). An incremental save that took such a chunk as unchanged would reference
the old bytes: a silent wrong checkpoint. So new chunks carry a 64-bit digest of their raw bytes (``digest``,
xxh3_64) and a chunk is referenced only when block hashes AND digest match; a CRC-32C chunk without a digest
(written before digests) is written again. The collisions below are real CRC-32C collisions, built by solving the
CRC's linear map, and go through real saves, loads, ``verify`` and ``diff``.
"""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest
import torch

import liferaft
from liferaft import CorruptCheckpointError, SaveOptions
from liferaft.cli import main
from liferaft.codecs.checksum import CHECKSUM_BITS, BlockHasher, block_hashes, chunk_digest
from liferaft.core.phases import tensor_digest
from liferaft.format.manifest import CHUNK_DIGEST, decode_manifest
from liferaft.state.values import digest_encoded, encode_value
from liferaft.testing.tamper import read_manifest, rewrite_manifest

BLOCK = 64 << 10            # the block size of a 1 MiB chunk (choose_block_size)


def _collide(old: bytes, new: bytearray, fix: int) -> None:
    """Set ``new[fix:fix + 4]`` so that ``crc32c(new) == crc32c(old)`` (same length). CRC-32C is affine over
    GF(2) for a fixed length: the CRC as a function of those 32 bits is ``f(0) ^ L(x)`` with ``L`` linear and
    invertible (a CRC detects every burst of up to 32 bits); solve ``L(x) = crc(old) ^ f(0)``."""
    def f(x: int) -> int:
        new[fix:fix + 4] = x.to_bytes(4, "little")
        return crc32c.crc32c(bytes(new))

    f0 = f(0)
    basis: dict[int, tuple[int, int]] = {}          # leading bit -> (L(combo), combo)
    for i in range(32):
        v, combo = f(1 << i) ^ f0, 1 << i
        while v:
            top = v.bit_length() - 1
            if top not in basis:
                basis[top] = (v, combo)
                break
            v, combo = v ^ basis[top][0], combo ^ basis[top][1]
    want, x = crc32c.crc32c(old) ^ f0, 0
    while want:
        v, combo = basis[want.bit_length() - 1]
        want, x = want ^ v, x ^ combo
    f(x)
    assert crc32c.crc32c(bytes(new)) == crc32c.crc32c(old) and bytes(new) != old


def _colliding(t: torch.Tensor, block: int = 1) -> torch.Tensor:
    """A copy of float32 ``t`` (one 1 MiB chunk) changed in one element of hash block ``block`` only, with four
    more bytes of that block chosen so that every block's CRC-32C is unchanged."""
    raw = bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())
    lo = block * BLOCK
    old = bytes(raw[lo:lo + BLOCK])
    piece = bytearray(old)
    piece[100:104] = (int.from_bytes(piece[100:104], "little") ^ 0x00400000).to_bytes(4, "little")  # a mantissa bit
    _collide(old, piece, 4000)
    raw[lo:lo + BLOCK] = piece
    out = torch.frombuffer(raw, dtype=torch.float32).reshape(t.shape).clone()
    assert block_hashes(memoryview(raw), BLOCK) == block_hashes(memoryview(t.numpy().tobytes()), BLOCK)
    return out


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(256, 1024, generator=g), "other": torch.randn(256, 1024, generator=g)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _chunks(path: Path) -> dict[str, dict]:
    doc, _ = read_manifest(path)
    return {t["key"]: t["chunks"][0] for t in doc["tensors"]}


@pytest.mark.parametrize("how", ["raw", "compressed", "delta"])
def test_a_chunk_whose_block_crcs_collide_is_written_not_referenced(tmp_path, how, capsys):
    state = _state()
    opts = {"raw": {"compression": "off"}, "compressed": {"compression": "on"},
            "delta": {"compression": "off", "delta": ("emb",)}}[how]
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(**opts))
    assert all(len(c["digest"]) == 16 for c in _chunks(tmp_path / "a").values())
    state["emb"] = _colliding(state["emb"])
    b = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", **opts))
    chunks = _chunks(tmp_path / "b")
    assert not chunks["emb"]["file"].startswith("../"), "a changed chunk was referenced as unchanged"
    assert chunks["other"]["file"].startswith("../a/")          # the unchanged one still is
    assert b.bytes_reused == state["other"].nbytes
    assert chunks["emb"]["digest"] == chunk_digest(memoryview(state["emb"].numpy()).cast("B"))
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(str(tmp_path / "b"), got)
    for k in state:
        assert torch.equal(_bits(got[k]), _bits(state[k])), k
    liferaft.verify(str(tmp_path / "b"))
    r = liferaft.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(k.key, k.status) for k in r.changed()] == [("emb", "changed")]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "emb" in capsys.readouterr().out


def test_a_collision_in_every_block_of_a_chunk_is_still_caught(tmp_path):
    """The digest covers the whole chunk, not one block: a change in several blocks, each CRC-colliding."""
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    t = state["emb"]
    for blk in (0, 5, 15):
        t = _colliding(t, blk)
    state["emb"] = t
    liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off"))
    assert not _chunks(tmp_path / "b")["emb"]["file"].startswith("../")
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(str(tmp_path / "b"), got)
    assert torch.equal(_bits(got["emb"]), _bits(state["emb"]))


def test_a_crc32c_chunk_without_a_digest_is_written_again(tmp_path):
    """Chunks written by CRC-32C liferaft before digests are never referenced, even when unchanged (their 32-bit
    block hashes cannot tell); an unchanged chunk with a digest is."""
    state = _state()
    for name in ("a", "old"):
        liferaft.save(str(tmp_path / name), state, options=SaveOptions(compression="off"))

    def strip(doc: dict) -> None:
        for t in doc["tensors"]:
            for c in t["chunks"]:
                del c["digest"]
    rewrite_manifest(tmp_path / "old", strip)
    assert liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off")
                         ).bytes_reused == 2 * state["emb"].nbytes
    c = liferaft.save(str(tmp_path / "c"), state, options=SaveOptions(incremental_base="old", compression="off"))
    assert c.bytes_reused == 0
    assert not any(ch["file"].startswith("../") for ch in _chunks(tmp_path / "c").values())
    assert all("digest" in ch for ch in _chunks(tmp_path / "c").values())
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(str(tmp_path / "c"), got)
    assert all(torch.equal(_bits(got[k]), _bits(state[k])) for k in state)
    # the chain goes on: c's chunks carry digests again, so a save on c references them
    assert liferaft.save(str(tmp_path / "d"), state, options=SaveOptions(incremental_base="c", compression="off")
                         ).bytes_reused == 2 * state["emb"].nbytes


def test_a_referenced_chunk_keeps_its_digest_and_a_lossy_chunk_has_none(tmp_path):
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off", quantize=("other",)))
    a = _chunks(tmp_path / "a")
    assert "digest" not in a["other"] and a["other"]["codec"] == "q8-block"
    liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off",
                                                                  quantize=("other",)))
    b = _chunks(tmp_path / "b")
    assert b["emb"]["file"].startswith("../a/") and b["emb"]["digest"] == a["emb"]["digest"]
    assert not b["other"]["file"].startswith("../")


@pytest.mark.parametrize("bad", ["ABCDEF0123456789", "0123", "0123456789abcdeg", 12, ["0" * 16], "0" * 17])
@pytest.mark.parametrize("where", ["chunk", "delta base"])
def test_a_malformed_digest_is_refused_naming_the_file(tmp_path, bad, where):
    liferaft.save(str(tmp_path / "a"), _state(), options=SaveOptions(compression="off"))
    liferaft.save(str(tmp_path / "b"), _state(1), options=SaveOptions(compression="off", incremental_base="a",
                                                                      delta=("emb",)))
    doc, name = read_manifest(tmp_path / "b")
    t = next(t for t in doc["tensors"] if t["key"] == "emb")
    (t["chunks"][0]["delta"] if where == "delta base" else t["chunks"][0])["digest"] = bad
    import json

    with pytest.raises(CorruptCheckpointError, match=f"{name}.*digest"):
        decode_manifest(json.dumps(doc).encode(), name)


def test_a_digest_survives_the_manifest_round_trip_fast_and_slow(tmp_path):
    liferaft.save(str(tmp_path / "a"), _state(), options=SaveOptions(compression="off"))
    liferaft.save(str(tmp_path / "b"), _state(1), options=SaveOptions(compression="off", incremental_base="a",
                                                                      delta=("emb",)))
    for name in ("a", "b"):
        doc, fname = read_manifest(tmp_path / name)
        m = decode_manifest((tmp_path / name / fname).read_bytes(), fname)
        for t, entry in zip(doc["tensors"], m.tensors):
            rec = entry.chunks[0]
            assert rec.digest == t["chunks"][0]["digest"]
            if rec.delta is not None:
                assert rec.delta.digest == t["chunks"][0]["delta"]["digest"]
        assert decode_manifest(m.to_json_bytes(), fname) == m


def test_the_streamed_digest_is_the_whole_chunks_in_any_pieces():
    data = memoryview(bytes(range(256)) * 5000).cast("B")
    for step in (1, 4096, 65536, 100_000, len(data)):
        h = BlockHasher(BLOCK, whole=True)
        for i in range(0, len(data), step):
            h.update(data[i:i + step])
        assert h.digest() == chunk_digest(data) and h.finish() == block_hashes(data, BLOCK)
    assert BlockHasher(BLOCK).digest() is None


def test_every_equality_digest_has_64_bits():
    """The other places that decide equality by a digest: replicated plain tensors and plain values across ranks
    (xxh3_64 of the whole), the chunk digest, and any block checksum an unchanged chunk may rest on alone."""
    assert CHUNK_DIGEST == "xxh3_64" and CHECKSUM_BITS[CHUNK_DIGEST] == 64
    assert len(tensor_digest(torch.arange(10))) == 16
    assert len(digest_encoded(encode_value({"a": [1, 2]}, "k"))) == 16
