"""Block checksum algorithms recorded per chunk (docs/FORMAT.md §3.1): saves write CRC-32C, checkpoints written with
xxh3_64 keep loading, every reader verifies a chunk by the algorithm its record names, a manifest or chunk naming an
unknown algorithm is refused by name, and an incremental chain may mix algorithms (an unchanged chunk is recognised
across the change and referenced with its own algorithm)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import liferaft
from liferaft import CorruptCheckpointError, SaveOptions
from liferaft.codecs.checksum import BlockHasher, block_hashes, digest, verify_blocks
from liferaft.format.manifest import CHECKSUM_ALGO, CHECKSUM_ALGOS, LEGACY_CHECKSUM, decode_manifest
from liferaft.testing.tamper import read_manifest, rewrite_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(512, 1024, generator=g),            # 2 MiB: 32 blocks of 64 KiB
            "small": torch.randn(7, 3, generator=g), "ints": torch.arange(40_000, dtype=torch.int64)}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def _as_legacy(path: Path) -> None:
    """Turn a raw (uncompressed) checkpoint into what liferaft wrote before CRC-32C: every block hash xxh3_64, the
    manifest naming xxh3_64 and no chunk naming an algorithm (re-sealed)."""
    def edit(doc: dict) -> None:
        doc["checksum"] = LEGACY_CHECKSUM
        for t in doc["tensors"]:
            for c in t["chunks"]:
                assert "codec" not in c and "delta" not in c
                c.pop("checksum", None)
                with open(path / c["file"], "rb") as f:
                    f.seek(c["byte_offset"])
                    data = f.read(c["length"])
                c["hashes"] = block_hashes(memoryview(data), c["block_size"], LEGACY_CHECKSUM)
    rewrite_manifest(path, edit)


def _flip_byte(path: Path, key: str, at: int = 70_000) -> None:
    doc, _ = read_manifest(path)
    (c,) = next(t for t in doc["tensors"] if t["key"] == key)["chunks"]
    with open(path / c["file"], "r+b") as f:
        f.seek(c["byte_offset"] + at)
        b = f.read(1)
        f.seek(c["byte_offset"] + at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_block_functions_agree_and_detect_a_flipped_bit(algo):
    data = bytearray(os.urandom(300_001))
    hashes = block_hashes(memoryview(data), 65536, algo)
    h = BlockHasher(65536, algo)
    for i in range(0, len(data), 77_777):                 # pieces that split blocks
        h.update(memoryview(data)[i:i + 77_777])
    assert h.finish() == hashes and len(hashes) == 5
    verify_blocks(memoryview(data), hashes, 65536, "x", algo)
    data[200_000] ^= 0x10
    with pytest.raises(CorruptCheckpointError, match=f"block 3 .*{algo}"):
        verify_blocks(memoryview(data), hashes, 65536, "x", algo)


def test_crc32c_is_the_castagnoli_crc():
    assert digest(b"123456789", "crc32c") == "e3069283"            # the CRC-32C check value (RFC 3720 B.4)
    with pytest.raises(CorruptCheckpointError, match="'sha1' is unknown to this liferaft"):
        digest(b"x", "sha1")


def test_a_save_records_crc32c_and_old_checkpoints_name_xxh3(tmp_path):
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    doc, _ = read_manifest(tmp_path / "a")
    assert doc["checksum"] == CHECKSUM_ALGO == "crc32c"
    assert all("checksum" not in c and all(len(h) == 8 for h in c["hashes"]) for t in doc["tensors"]
               for c in t["chunks"])
    for golden in ("v1", "v3"):
        (name,) = (GOLDEN / golden).glob("manifest-*.json")
        m = decode_manifest(name.read_bytes())
        assert {c.checksum for t in m.tensors for c in t.chunks} == {LEGACY_CHECKSUM}
        assert m.default_checksum() == LEGACY_CHECKSUM and m.to_json_bytes() == name.read_bytes()


@pytest.mark.parametrize("legacy", [False, True], ids=["crc32c", "xxh3_64"])
@pytest.mark.parametrize("compression", ["off", "on"])
def test_a_corrupt_block_is_detected_with_each_algorithm(tmp_path, legacy, compression):
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression=compression))
    if legacy:
        if compression == "on":
            pytest.skip("xxh3_64 encoded chunks are covered by tests/golden/v2")
        _as_legacy(tmp_path / "a")
    got = _zeros(state)
    liferaft.load(str(tmp_path / "a"), got)
    _same(got, state)
    assert liferaft.verify(str(tmp_path / "a")).bytes_checked == sum(v.nbytes for v in state.values())
    if compression == "on":               # damage a frame's payload: the decoder or the hash refuses it
        _flip_byte(tmp_path / "a", "ints", at=100)
    else:
        _flip_byte(tmp_path / "a", "big")
    with pytest.raises(CorruptCheckpointError):
        liferaft.load(str(tmp_path / "a"), _zeros(state))
    with pytest.raises(CorruptCheckpointError):
        liferaft.verify(str(tmp_path / "a"))


@pytest.mark.parametrize("where", ["manifest", "chunk"])
def test_an_unknown_algorithm_is_refused_by_name(tmp_path, where):
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))

    def edit(doc: dict) -> None:
        if where == "manifest":
            doc["checksum"] = "blake9"
        else:
            doc["tensors"][0]["chunks"][0]["checksum"] = "blake9"
    rewrite_manifest(tmp_path / "a", edit)
    with pytest.raises(CorruptCheckpointError, match="'blake9' is unknown to this liferaft.*upgrade liferaft"):
        liferaft.load(str(tmp_path / "a"), _zeros(state))
    for bad in ([], None, 5, {"a": 1}):
        rewrite_manifest(tmp_path / "a", lambda d, bad=bad: d.__setitem__("checksum", bad))
        with pytest.raises(CorruptCheckpointError, match="block checksum algorithm"):
            liferaft.read(str(tmp_path / "a"))


def test_a_chunk_naming_the_manifest_default_or_another_known_algorithm_reads(tmp_path):
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    _as_legacy(tmp_path / "a")

    def edit(doc: dict) -> None:        # manifest says crc32c, every chunk says xxh3_64 (as a mixed chain does)
        doc["checksum"] = "crc32c"
        for t in doc["tensors"]:
            for c in t["chunks"]:
                c["checksum"] = "xxh3_64"
    rewrite_manifest(tmp_path / "a", edit)
    got = _zeros(state)
    liferaft.load(str(tmp_path / "a"), got)
    _same(got, state)
    rewrite_manifest(tmp_path / "a", lambda d: d["tensors"][0]["chunks"][0].__setitem__("checksum", "crc32c"))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):      # xxh3 hashes read as crc32c
        liferaft.load(str(tmp_path / "a"), _zeros(state))


def test_a_mixed_algorithm_incremental_chain_loads(tmp_path):
    """a: written before CRC-32C (xxh3_64); b: incremental on a, unchanged chunks referenced with their xxh3_64
    hashes, the changed one CRC-32C, a delta on an xxh3_64 base; c: incremental on b. Each loads bit-exact, each
    verifies, and damage to a's bytes is caught through b and c by a's own algorithm."""
    state = _state()
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    _as_legacy(tmp_path / "a")
    state["small"] += 1
    state["ints"][:10] = -1
    b = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off",
                                                                      delta=("ints",)))
    assert b.bytes_reused == state["big"].nbytes
    doc, _ = read_manifest(tmp_path / "b")
    chunks = {t["key"]: t["chunks"][0] for t in doc["tensors"]}
    assert doc["checksum"] == "crc32c"
    assert chunks["big"]["file"].startswith("../a/") and chunks["big"]["checksum"] == "xxh3_64"
    assert "checksum" not in chunks["small"] and len(chunks["small"]["hashes"][0]) == 8
    assert chunks["ints"]["delta"]["checksum"] == "xxh3_64" and "checksum" not in chunks["ints"]
    state_b = {k: v.clone() for k, v in state.items()}
    state["small"] += 1
    liferaft.save(str(tmp_path / "c"), state, options=SaveOptions(incremental_base="b", compression="off"))
    doc, _ = read_manifest(tmp_path / "c")
    assert {t["key"]: t["chunks"][0].get("checksum") for t in doc["tensors"]}["big"] == "xxh3_64"
    for name, want in (("b", state_b), ("c", state)):
        got = _zeros(want)
        liferaft.load(str(tmp_path / name), got)
        _same(got, want)
        assert liferaft.verify(str(tmp_path / name)).bytes_checked == sum(v.nbytes for v in want.values())
    shutil.copytree(tmp_path / "a", tmp_path / "a.bak")
    _flip_byte(tmp_path / "a", "big")
    for name in ("b", "c"):
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*xxh3_64"):
            liferaft.load(str(tmp_path / name), _zeros(state))
