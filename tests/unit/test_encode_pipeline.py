"""Compressed saves encode chunk i+1 while chunk i's frames are written (``core.chunks.encoding``): the round trip
stays bit-exact whatever the pool size, compressible and incompressible and lossy chunks mixed; an exception in an
encoder thread fails the write, leaves no data file and gives the pool back (so nothing can be committed)."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
import tracemalloc
from typing import ClassVar

import pytest
import torch

import liferaft
from liferaft import SaveOptions
from liferaft.codecs import registry
from liferaft.codecs.bytegroup import ByteGroupZstd
from liferaft.core.chunks import behind, encoding
from liferaft.core.chunks.behind import WriteBehind
from liferaft.core.chunks.writer import ChunkPolicy, write_streamed
from liferaft.planning.save_plan import WriteItem
from liferaft.staging.pool import BufferPool
from liferaft.storage import register_scheme
from liferaft.storage.posix import PosixStorage, _PosixWriter
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


class _Recording(ByteGroupZstd):
    """The lossless codec under another name, recording the thread that encodes each block."""

    name = "test-recording"

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode_block(self, block: memoryview, dtype: str) -> bytes:
        self.threads.append(threading.current_thread().name)
        return super().encode_block(block, dtype)

    def encode_chunk(self, blocks, dtype, pool, pays=None):        # the contract's generic path (no shortcut)
        return super(ByteGroupZstd, self).encode_chunk(blocks, dtype, pool, pays)


class _Writer(_PosixWriter):
    """Records the thread of every positioned write; raises on the ``fail_at``-th one (0: never)."""

    fail_at = 0
    seen: ClassVar[list[str]] = []

    def pwrite(self, data, offset: int) -> None:
        type(self).seen.append(threading.current_thread().name)
        if len(type(self).seen) == type(self).fail_at:
            raise OSError(errno.EIO, "injected on the I/O thread")
        super().pwrite(data, offset)


def _storage_with(writer: type[_PosixWriter]) -> type[PosixStorage]:
    """A POSIX storage whose data-file writers are ``writer``s."""
    class _Storage(PosixStorage):
        def open_writer(self, name: str):
            path = self._p(name)
            self._mkdirs(path)
            return writer(path)
    return _Storage


_RecordingStorage = _storage_with(_Writer)


def _items(tensors: dict[str, torch.Tensor]) -> tuple[list[WriteItem], dict, int]:
    items, pos = [], 0
    for k, t in tensors.items():
        items.append(WriteItem(key=k, offsets=(0,), sizes=(t.numel(),), file="data/x/r00000.bin", byte_offset=pos,
                               length=t.nbytes))
        pos += t.nbytes
    return items, {(k, ((0,), (t.numel(),))): t for k, t in tensors.items()}, pos


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
def test_encoded_frames_are_written_by_the_io_thread_and_encoding_uses_the_save_kind_threads(tmp_path, foreground):
    """Every write of an encoded chunk's frames (or of a chunk the codec declined) runs on the I/O thread, not on
    the thread that hashes the next pieces; a sync save's blocks (``foreground``) are encoded on the foreground
    codec threads (one per core), a background save's on the save threads (half the cores); the stored bytes are
    the same either way."""
    tensors = {f"t{i}": torch.linspace(0, i + 1, 64 * 1024) for i in range(6)}
    tensors["noise"] = torch.randint(0, 256, (256 * 1024,), dtype=torch.uint8, generator=torch.Generator()
                                     .manual_seed(1))
    items, sources, _ = _items(tensors)
    codec = _Recording()
    policy = ChunkPolicy(dtypes={k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
                         block_size=64 << 10, lossy={k: "test-recording" for k in tensors},
                         codecs=registry.CodecRegistry((codec,)), foreground=foreground)
    _Writer.seen, _Writer.fail_at = [], 0
    pool = BufferPool(1 << 20)
    out = write_streamed(_RecordingStorage(str(tmp_path)), items, sources, pool, policy)
    assert pool.in_use == 0 and _Writer.seen and set(_Writer.seen) == {"liferaft-write"}
    want = "liferaft-decode" if foreground else "liferaft-codec"
    pooled = [n for n in codec.threads if not n.startswith("liferaft-encode")]   # (a chunk's first block: there)
    assert pooled and all(n.startswith(want) for n in pooled), set(codec.threads)
    data = (tmp_path / "data" / "x" / "r00000.bin").read_bytes()
    assert out.file_size == len(data) and out.bytes_encoded == sum(t.nbytes for k, t in tensors.items() if k != "noise")
    assert [c.codec is None for c in out.chunks] == [False] * 6 + [True]        # (the noise: declined, raw)
    other = tmp_path / "other"
    write_streamed(PosixStorage(str(other)), items, sources, BufferPool(1 << 20),
                   dataclasses.replace(policy, foreground=not foreground))
    assert (other / "data" / "x" / "r00000.bin").read_bytes() == data


def test_a_write_error_on_the_io_thread_fails_the_save_and_frees_the_pool(tmp_path):
    """A positioned write of encoded frames that fails on the I/O thread (the 3rd write here) fails the write with
    a StorageError, leaves no data file, and gives every pool region back; the next save works."""
    tensors = {f"t{i}": torch.linspace(0, i + 1, 64 * 1024) for i in range(8)}
    items, sources, pos = _items(tensors)
    policy = ChunkPolicy(dtypes={k: "float32" for k in tensors}, block_size=64 << 10, compress=True)
    _Writer.seen, _Writer.fail_at = [], 3
    pool = BufferPool(1 << 20)
    with pytest.raises(liferaft.errors.StorageError, match="injected on the I/O thread"):
        write_streamed(_RecordingStorage(str(tmp_path)), items, sources, pool, policy)
    assert not os.path.exists(tmp_path / "data" / "x" / "r00000.bin") and pool.in_use == 0
    _Writer.seen, _Writer.fail_at = [], 0
    out = write_streamed(_RecordingStorage(str(tmp_path)), items, sources, pool, policy)
    assert out.bytes_encoded == pos and pool.in_use == 0


@pytest.mark.parametrize("budget", [None, 2 << 20], ids=["default-pool", "small-pool"])
def test_references_deltas_encoded_declined_and_raw_chunks_mixed_round_trip(tmp_path, budget):
    """An incremental, compressed save whose chunks are, in plan order, references to the base (unchanged), XOR
    deltas against it, encoded, declined by the codec (noise) and raw: the pool regions are released in the order
    taken whatever each chunk became (a reference is decided while earlier frames are still being written), and
    the checkpoint loads bit-exact and verifies."""
    g = torch.Generator().manual_seed(5)
    state = {}
    for i in range(6):
        state[f"w{i}"] = torch.linspace(0, 1, 192 * 1024) * (i + 1)
        state[f"n{i}"] = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=g)
        state[f"d{i}"] = torch.linspace(-1, 1, 160 * 1024) * (i + 2)
    opts = dict(compression="on", memory_budget=budget, chunk_bytes=256 << 10)
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(**opts))
    for i in range(0, 6, 2):
        state[f"w{i}"].add_(0.5)
        state[f"n{i}"].add_(1)
        state[f"d{i}"][::7].add_(1.0)
    r = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(**opts, incremental_base="a",
                                                                      delta=("d*",)))
    assert 0 < r.bytes_written < sum(v.nbytes for v in state.values())
    doc, _ = read_manifest(tmp_path / "b")
    kinds = {("reference" if c["file"].startswith("../") else "delta" if "delta" in c else
              "encoded" if c.get("codec") else "declined") for t in doc["tensors"] for c in t["chunks"]}
    assert kinds == {"reference", "delta", "encoded", "declined"}
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(str(tmp_path / "b"), got)
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert liferaft.verify(str(tmp_path / "b")).bytes_checked == sum(v.nbytes for v in state.values())


def test_write_behind_bounds_the_bytes_its_queued_jobs_hold():
    """``submit(..., holds=n)`` waits while the jobs queued before hold ``limit`` bytes or more; a job holding
    more than the limit alone still runs; an error wakes a waiting submit, which raises it."""
    gate = threading.Event()
    wb = WriteBehind(limit=100)
    wb.submit(lambda: gate.wait(10), holds=60)
    wb.submit(lambda: None, holds=30)                  # 90 in all: queued at once
    late = threading.Thread(target=lambda: wb.submit(lambda: None, holds=30))    # 120 > 100: waits
    late.start()
    late.join(0.3)
    assert late.is_alive()
    gate.set()
    late.join(10)
    assert not late.is_alive()
    wb.flush()
    wb.close()
    alone = WriteBehind(limit=10)
    alone.submit(lambda: None, holds=50)
    alone.flush()
    alone.close()
    broken, gate2, raised = WriteBehind(limit=10), threading.Event(), []

    def fails() -> None:
        gate2.wait(10)
        raise OSError(errno.EIO, "injected")

    def submit_late() -> None:
        try:
            broken.submit(lambda: None, holds=10)
        except OSError as e:
            raised.append(e)
    broken.submit(fails, holds=10)
    waiter = threading.Thread(target=submit_late)
    waiter.start()
    gate2.set()
    waiter.join(10)
    assert not waiter.is_alive() and raised and "injected" in str(raised[0])
    broken.close()


class _SlowWriter(_PosixWriter):
    def pwrite(self, data, offset: int) -> None:
        time.sleep(0.03)
        super().pwrite(data, offset)


_SlowStorage = _storage_with(_SlowWriter)


def test_encoded_frames_waiting_for_slow_storage_stay_within_the_limit(tmp_path, monkeypatch):
    """On storage slower than the codec, the frames of encoded chunks waiting for the I/O thread stay within
    ``behind.LIMIT`` (here 2 MiB), not up to the whole state's compressed size (the async pool is the whole
    snapshot): measured as the peak of Python-heap memory (the frames; the pool is not on that heap). Measured:
    3.9 MiB with the limit, 14.4 MiB without."""
    monkeypatch.setattr(behind, "LIMIT", 2 << 20)
    register_scheme("slowframes", _SlowStorage)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256 * 1024, generator=g).to(torch.bfloat16).float() for i in range(48)}
    raw = sum(v.nbytes for v in state.values())             # 48 MiB, stored as ~24 MiB of frames
    tracemalloc.start()
    try:
        liferaft.async_save(f"slowframes://{tmp_path}/a", state,
                            options=SaveOptions(compression="on", chunk_bytes=1 << 20)).wait()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    r = liferaft.read(str(tmp_path / "a"))
    assert all(torch.equal(r[k], v) for k, v in state.items())
    stored = sum(f.stat().st_size for f in (tmp_path / "a" / "data").rglob("*.bin"))
    assert stored < raw * 0.7
    assert peak < 8 << 20, peak     # the limit, the frames of the chunks encoding, the rest of the save
