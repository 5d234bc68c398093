"""Compressed saves encode chunk i+1 while chunk i's frames are written (``core.chunks.encoding``): the round trip
stays bit-exact whatever the pool size, compressible and incompressible and lossy chunks mixed; an exception in an
encoder thread fails the write, leaves no data file and gives the pool back (so nothing can be committed)."""

from __future__ import annotations

import os

import pytest
import torch

import liferaft
from liferaft import SaveOptions
from liferaft.codecs import registry
from liferaft.codecs.bytegroup import ByteGroupZstd
from liferaft.core.chunks import encoding
from liferaft.core.chunks.writer import ChunkPolicy, write_streamed
from liferaft.planning.save_plan import WriteItem
from liferaft.staging.pool import BufferPool
from liferaft.storage.posix import PosixStorage
from liferaft.testing.tamper import read_manifest


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for i in range(12):
        smooth = torch.linspace(0, 1, 256 * 1024).reshape(256, 1024) * (i + 1)       # 1 MiB, compresses
        out[f"smooth{i}"] = smooth
        out[f"noise{i}"] = torch.randint(0, 256, (300_000 + 4096 * i,), dtype=torch.uint8, generator=g)   # does not
    out["moments"] = torch.rand(512, 512, generator=g)
    out["tiny"] = torch.arange(5, dtype=torch.int16)
    return out


@pytest.mark.parametrize("budget", [None, 3 << 20], ids=["default-pool", "small-pool"])
def test_pipelined_compressed_save_round_trips_bit_exact(tmp_path, budget):
    state = _state()
    r = liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="on", memory_budget=budget,
                                                                      chunk_bytes=512 << 10,
                                                                      quantize=("moments",)))
    doc, _ = read_manifest(tmp_path / "a")
    codecs = {t["key"]: {c.get("codec") for c in t["chunks"]} for t in doc["tensors"]}
    assert codecs["smooth3"] == {registry.LOSSLESS} and codecs["noise3"] == {None}
    assert codecs["moments"] == {registry.QUANTIZE}
    assert r.bytes_written < sum(v.nbytes for v in state.values())
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.warns(UserWarning, match="moments"):
        liferaft.load(str(tmp_path / "a"), got)
    bound = next(t for t in doc["tensors"] if t["key"] == "moments")["lossy"]["max_abs_error"]
    for k, v in state.items():
        if k == "moments":
            assert 0 < (got[k] - v).abs().max() <= bound
        else:
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert liferaft.verify(str(tmp_path / "a")).bytes_checked == sum(v.nbytes for v in state.values())


class _FailsOnThirdBlock(ByteGroupZstd):
    """The lossless codec under another name, whose encoder raises on the third block it is given."""

    name = "test-fails-3"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode_block(self, block: memoryview, dtype: str) -> bytes:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("encoder broke on purpose")
        return super().encode_block(block, dtype)

    def encode_chunk(self, blocks, dtype, pool, pays=None):        # the contract's generic path (no shortcut)
        return super(ByteGroupZstd, self).encode_chunk(blocks, dtype, pool, pays)


def test_an_encoder_error_surfaces_and_nothing_is_left(tmp_path):
    storage = PosixStorage(str(tmp_path))
    tensors = {f"t{i}": torch.linspace(0, i + 1, 64 * 1024) for i in range(6)}     # 256 KiB each: 4 blocks
    items, pos = [], 0
    for k, t in tensors.items():
        items.append(WriteItem(key=k, offsets=(0,), sizes=(t.numel(),), file="data/x/r00000.bin", byte_offset=pos,
                               length=t.nbytes))
        pos += t.nbytes
    sources = {(k, ((0,), (t.numel(),))): t for k, t in tensors.items()}
    own = registry.CodecRegistry((_FailsOnThirdBlock(),))
    policy = ChunkPolicy(dtypes={k: "float32" for k in tensors}, block_size=64 << 10,
                         lossy={k: "test-fails-3" for k in tensors}, codecs=own)
    pool = BufferPool(1 << 20)
    with pytest.raises(RuntimeError, match="encoder broke on purpose"):
        write_streamed(storage, items, sources, pool, policy)
    assert not os.path.exists(tmp_path / "data" / "x" / "r00000.bin")
    assert pool.in_use == 0
    # the pool and the encoding thread serve the next write as before
    good = ChunkPolicy(dtypes={k: "float32" for k in tensors}, block_size=64 << 10, compress=True)
    out = write_streamed(storage, items, sources, pool, good)
    assert [c.codec for c in out.chunks] == [registry.LOSSLESS] * 6 and pool.in_use == 0
    assert out.bytes_encoded == pos and out.file_size == os.path.getsize(tmp_path / "data" / "x" / "r00000.bin")
    assert encoding.MAX_IN_FLIGHT >= 2
