"""The codec contract (``liferaft.codecs.base``), checked on every registered codec: a codec added to the registry is
tested by being registered. Round trip (lossless: bit exact; lossy: within the codec's stated bound), damage in a
frame is an error (a LiferaftError, never a silent wrong value nor a raw exception), a partial decode of a block
range equals that slice of the full decode, empty and odd-sized blocks. Then the registry's lookups, the manifest
refusing an unknown codec, ``compression="auto"`` as a function of its inputs, and the codec threads' lifetime."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
import xxhash

import liferaft
from liferaft import SaveOptions
from liferaft.codecs import advisor, frames, registry
from liferaft.codecs.base import Codec
from liferaft.codecs.checksum import block_hashes, verify_blocks
from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.format.manifest import CHECKSUM_ALGO, DTYPE_ITEMSIZE

pytest.importorskip("zstandard")

BLOCK = 4096


def sample(dtype: str, numel: int, seed: int = 0) -> bytes:
    """Bytes of ``numel`` values of ``dtype`` shaped like training state (small normal floats, small integers)."""
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    if tdt.is_floating_point:
        t = (torch.randn(numel, generator=g) * 0.02).to(tdt)
    elif tdt.is_complex:
        t = (torch.randn(numel, 2, generator=g, dtype=torch.float64) * 0.02).to(torch.float32 if dtype ==
                                                                                 "complex64" else torch.float64)
        t = torch.view_as_complex(t.contiguous())
    elif tdt == torch.bool:
        t = torch.rand(numel, generator=g) > 0.5
    else:
        t = torch.randint(0, 7, (numel,), generator=g).to(tdt)
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if numel else b""


def cases() -> list:
    """(codec, dtype) for every registered codec and every manifest dtype it accepts."""
    return [pytest.param(c, d, id=f"{c.name}-{d}") for c in registry.CODECS for d in sorted(DTYPE_ITEMSIZE)
            if c.accepts(d)]


def encode(codec: Codec, raw: bytes, dtype: str, block: int = BLOCK) -> tuple[bytes, list[int], list[str]]:
    """(stored bytes, frame lengths, block hashes a reader verifies) of a chunk of ``raw``, as the writer makes them."""
    mv = memoryview(raw)
    blocks = [mv[i:i + block] for i in range(0, len(mv), block)]
    enc = codec.encode_chunk(blocks, dtype, frames.executor())
    assert enc is not None and len(enc.frames) == len(blocks)
    return b"".join(enc.frames), [len(f) for f in enc.frames], list(enc.hashes or block_hashes(mv, block))


def decode(codec: Codec, stored: bytes, lengths: list[int], hashes: list[str], size: int, dtype: str,
           block: int = BLOCK) -> bytes:
    """Decode and verify as a reader does."""
    out = bytearray(size)
    frames.decode_frames(memoryview(stored), lengths, codec.name, memoryview(out), block, dtype, "test chunk")
    verify_blocks(memoryview(out), hashes, block, "test chunk", CHECKSUM_ALGO)
    return bytes(out)


def assert_within_bound(codec: Codec, raw: bytes, got: bytes, dtype: str, block: int = BLOCK) -> None:
    if codec.lossless:
        assert got == raw
        return
    tdt = getattr(torch, dtype)
    for lo in range(0, len(raw), block):
        a = torch.frombuffer(bytearray(raw[lo:lo + block]), dtype=tdt).double()
        b = torch.frombuffer(bytearray(got[lo:lo + block]), dtype=tdt).double()
        bound = codec.error_bound(memoryview(raw)[lo:lo + block], dtype)
        assert float((a - b).abs().max()) <= bound, (lo, float((a - b).abs().max()), bound)


# ------------------------------------------------------------------------------------------------ the contract

@pytest.mark.parametrize("codec,dtype", cases())
def test_round_trip_within_the_stated_bound(codec, dtype):
    item = DTYPE_ITEMSIZE[dtype]
    raw = sample(dtype, (3 * BLOCK + 5 * 16) // item + 1)        # 4 blocks, the last one short and odd
    stored, lengths, hashes = encode(codec, raw, dtype)
    got = decode(codec, stored, lengths, hashes, len(raw), dtype)
    assert_within_bound(codec, raw, got, dtype)
    if not codec.lossless:
        enc = codec.encode_chunk([memoryview(raw)], dtype, None)
        assert enc is not None and enc.error is not None and enc.error[2] == len(raw) // item
        assert enc.error[0] <= codec.error_bound(memoryview(raw), dtype)


@pytest.mark.parametrize("codec,dtype", cases())
def test_partial_decode_of_a_block_range_is_that_slice_of_the_full_decode(codec, dtype):
    raw = sample(dtype, 6 * BLOCK // DTYPE_ITEMSIZE[dtype] - 3, seed=1)
    stored, lengths, hashes = encode(codec, raw, dtype)
    full = decode(codec, stored, lengths, hashes, len(raw), dtype)
    for first, end in [(0, 1), (2, 4), (5, 6), (1, 6)]:
        lo, hi = first * BLOCK, min(end * BLOCK, len(raw))
        at = sum(lengths[:first])
        part = decode(codec, stored[at:at + sum(lengths[first:end])], lengths[first:end], hashes[first:end],
                      hi - lo, dtype)
        assert part == full[lo:hi]


@pytest.mark.parametrize("codec,dtype", cases())
def test_empty_and_odd_sized_blocks(codec, dtype):
    item = DTYPE_ITEMSIZE[dtype]
    empty = codec.encode_block(memoryview(b""), dtype)
    codec.decode_block(memoryview(empty), memoryview(bytearray(0)), dtype, "empty")
    assert codec.encode_chunk([], dtype, None) is not None
    for numel in (1, 3, 257, BLOCK // item + 1):
        raw = sample(dtype, numel, seed=numel)
        stored, lengths, hashes = encode(codec, raw, dtype, block=len(raw))       # one block, any length
        assert_within_bound(codec, raw, decode(codec, stored, lengths, hashes, len(raw), dtype, len(raw)), dtype,
                            len(raw))


def _flips(n: int, header: int = 96, every: int = 61):
    for pos in sorted(set(range(min(n, header))) | set(range(0, n, every)) | {n - 1}):
        for mask in (0x01, 0x80, 0xFF):
            yield pos, mask


@pytest.mark.parametrize("codec,dtype", [c for c in cases() if c.values[1] in ("float32", "bfloat16", "int64")])
def test_damage_in_a_frame_is_an_error_never_a_wrong_value(codec, dtype):
    raw = sample(dtype, 2 * BLOCK // DTYPE_ITEMSIZE[dtype] + 7, seed=2)
    stored, lengths, hashes = encode(codec, raw, dtype)
    good = decode(codec, stored, lengths, hashes, len(raw), dtype)
    tried = 0
    for pos, mask in _flips(len(stored)):
        bad = bytearray(stored)
        bad[pos] ^= mask
        try:
            got = decode(codec, bytes(bad), lengths, hashes, len(raw), dtype)
        except LiferaftError:
            tried += 1
            continue
        assert got == good, f"flipping byte {pos} with {mask:#x} decoded to other values without an error"
    assert tried > 100
    with pytest.raises(CorruptCheckpointError, match="truncated"):        # the stored bytes end early
        decode(codec, stored[:-1], lengths, hashes, len(raw), dtype)
    for cut in (1, 7, 30, lengths[0] - 1):                                # a frame cut short
        with pytest.raises(LiferaftError):
            decode(codec, stored[:cut], [cut], hashes[:1], BLOCK, dtype)
    shifted = [lengths[0] + 1, lengths[1] - 1] + lengths[2:]              # frame lengths that do not match
    with pytest.raises(LiferaftError):
        decode(codec, stored, shifted, hashes, len(raw), dtype)
    with pytest.raises(CorruptCheckpointError, match="the block has"):    # a frame of another length
        decode(codec, stored[:lengths[0]], lengths[:1], hashes[:1], BLOCK - DTYPE_ITEMSIZE[dtype], dtype)


# ------------------------------------------------------------------------------------------------ the registry

def test_the_registry_names_its_codecs_and_refuses_unknown_or_duplicate_ones():
    assert {registry.LOSSLESS, registry.QUANTIZE} <= set(registry.names())
    assert registry.get(registry.LOSSLESS).lossless and not registry.get(registry.QUANTIZE).lossless
    with pytest.raises(CorruptCheckpointError, match="key 'w'.*'lz9' is unknown.*upgrade liferaft"):
        registry.get("lz9", "key 'w'")
    with pytest.raises(CorruptCheckpointError, match="'lz9' is unknown"):
        frames.decode_frames(memoryview(b"x"), [1], "lz9", memoryview(bytearray(4)), 4, "float32", "chunk")
    own = registry.CodecRegistry()
    own.register(registry.get(registry.LOSSLESS))
    with pytest.raises(ValueError, match="already registered"):
        own.register(registry.get(registry.LOSSLESS))
    with pytest.raises(ValueError, match="lower-case"):
        own.register(object())  # type: ignore[arg-type]


def _read_json(path: str) -> dict:
    with open(path, "rb") as f:
        return json.load(f)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _edit_manifest(path: str, fn) -> str:
    marker = _read_json(os.path.join(path, "COMMIT"))
    doc = _read_json(os.path.join(path, marker["manifest"]))
    fn(doc)
    data = json.dumps(doc).encode()
    _write(os.path.join(path, marker["manifest"]), data)
    marker["manifest_size"], marker["manifest_hash"] = len(data), xxhash.xxh3_64_hexdigest(data)
    _write(os.path.join(path, "COMMIT"), json.dumps(marker).encode())
    return marker["manifest"]


def test_a_manifest_naming_an_unknown_codec_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "c")
    w = (torch.randn(512, 256) * 0.02)
    liferaft.save(path, {"w": w, "b": torch.ones(3)}, options=SaveOptions(compression="on"))

    def rename(doc):
        for t in doc["tensors"]:
            for c in t["chunks"]:
                if c.get("codec"):
                    c["codec"] = "lz9"
    _edit_manifest(path, rename)
    target = {"w": torch.zeros(512, 256), "b": torch.zeros(3)}
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w'.*'lz9' is unknown to this liferaft") as e:
        liferaft.load(path, target)
    assert "upgrade liferaft" in str(e.value) and bool((target["w"] == 0).all())
    with pytest.raises(CorruptCheckpointError, match="'lz9'"):
        liferaft.verify(path)


# ------------------------------------------------------------------------------------ compression="auto"

def _codecs(path: str) -> dict[str, set]:
    doc = _read_json(os.path.join(path, _read_json(os.path.join(path, "COMMIT"))["manifest"]))
    return {t["key"]: {c.get("codec") for c in t["chunks"]} for t in doc["tensors"]}


def test_auto_is_a_pure_function_of_the_options_and_the_storage_kind():
    assert advisor.should_compress(True, None, 1)                       # object store: always
    assert not advisor.should_compress(False, None, 8)                  # local, nothing stated: raw
    assert advisor.should_compress(False, 100e6, 1)                     # a slow disk: the codec keeps up
    assert not advisor.should_compress(False, 10e9, 1)                  # a fast one: it does not
    assert advisor.should_compress(False, 2 * advisor.ENCODE_BPS, 2) == advisor.should_compress(
        False, 2 * advisor.ENCODE_BPS, 2)


@pytest.mark.parametrize("rate", [None, 50e6])
def test_identical_saves_choose_the_same_codecs_whatever_ran_before(tmp_path, rate):
    """The same "auto" save before and after other saves of the process (a large raw one, a compressed one, a
    tiny one) writes the same codecs and the same bytes (before issue #15 it depended on the disk speed that the
    process's earlier raw saves had measured)."""
    state = {"w": (torch.randn(1024, 512, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16),
             "b": torch.arange(100000) % 5}
    opts = SaveOptions(storage_write_bps=rate)
    first = liferaft.save(str(tmp_path / "a"), state, options=opts)
    big = {"x": torch.randn(80 << 18)}                                   # 80 MiB, written raw: what the old
    liferaft.save(str(tmp_path / "big"), big, options=SaveOptions(compression="off"))   # advisor measured
    liferaft.save(str(tmp_path / "small"), {"y": torch.ones(10)}, options=SaveOptions(compression="on"))
    second = liferaft.save(str(tmp_path / "b"), state, options=opts)
    assert _codecs(str(tmp_path / "a")) == _codecs(str(tmp_path / "b"))
    assert first.bytes_written == second.bytes_written and first.bytes_encoded == second.bytes_encoded
    assert (first.bytes_encoded > 0) == (rate is not None and advisor.should_compress(False, rate, frames.threads()))


def test_storage_write_bps_must_be_a_positive_rate():
    with pytest.raises(liferaft.errors.OptionsError, match="storage_write_bps"):
        SaveOptions(storage_write_bps=0)


# ---------------------------------------------------------------------------------------------- thread pools

def test_codec_threads_are_bounded_and_released():
    raw = sample("float32", 40 * BLOCK // 4)
    mv = memoryview(raw)
    blocks = [mv[i:i + BLOCK] for i in range(0, len(mv), BLOCK)]
    registry.get(registry.LOSSLESS).encode_chunk(blocks, "float32", frames.executor())
    stored, lengths, hashes = encode(registry.get(registry.LOSSLESS), raw, "float32")
    decode(registry.get(registry.LOSSLESS), stored, lengths, hashes, len(raw), "float32")

    def alive(prefix: str) -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))
    assert 0 < alive("liferaft-codec") <= frames.threads()
    assert alive("liferaft-decode") <= max(1, os.cpu_count() or 1)
    liferaft.release()                                                  # (frames.shutdown)
    assert alive("liferaft-codec") == 0 and alive("liferaft-decode") == 0
    again = registry.get(registry.LOSSLESS).encode_chunk(blocks, "float32", frames.executor())   # new pools
    assert again is not None and len(again.frames) == len(blocks)


def test_complex128_saves_compressed_and_loads_bit_exact(tmp_path):
    """(Before: ``compression="on"`` raised a raw ValueError, "itemsize must be 1..8", for a complex128 tensor.)"""
    z = torch.view_as_complex(torch.randn(20000, 2, dtype=torch.float64) * 0.02)
    liferaft.save(str(tmp_path / "c"), {"z": z}, options=SaveOptions(compression="on"))
    got = {"z": torch.zeros_like(z)}
    liferaft.load(str(tmp_path / "c"), got)
    assert torch.equal(got["z"].view(torch.float64), z.view(torch.float64))
    assert _codecs(str(tmp_path / "c"))["z"] == {registry.LOSSLESS}
