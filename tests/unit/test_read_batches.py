"""A load from a device is cut into physical reads that keep the verify-and-copy overlapped with the I/O
(core.chunks.reader.batch_bytes): a small load takes several reads, not one, each within its bound, the last ones
shorter (tail_cap: little verify and copy left after the device is done); the result is bitwise; a damaged byte in
any read is refused and named."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.core.chunks.reader import DEPTH, MIN_BATCH, TAIL_MIN, batch_bytes, tail_cap
from liferaft.errors import CorruptCheckpointError
from liferaft.staging.pool import PAGE
from liferaft.storage.posix import PosixStorage
from liferaft.testing.tamper import read_manifest


@pytest.mark.parametrize("total", [0, 1, PAGE, MIN_BATCH - 1, 5 * MIN_BATCH + 17, 33_423_360, 200 << 20, 1 << 40])
@pytest.mark.parametrize("max_read", [1000, PAGE, 1 << 20, 8 << 20, 32 << 20])
def test_the_read_size_is_bounded_page_sized_and_cuts_a_small_load_into_several(total, max_read):
    size = batch_bytes(total, max_read)
    assert size == max_read or (size % PAGE == 0 and size <= max_read)
    if max_read >= MIN_BATCH:
        assert size >= MIN_BATCH                                    # never tiny requests
    if total >= DEPTH * max_read:
        assert size == max_read                                     # a large load reads as before
    if max_read >= MIN_BATCH and MIN_BATCH * DEPTH <= total < DEPTH * max_read:
        assert -(-total // size) >= DEPTH                           # a small one takes about DEPTH reads


@pytest.mark.parametrize("max_read", [PAGE, 1 << 20, 4 << 20, 32 << 20])
def test_the_reads_shrink_toward_the_end_of_a_load(max_read):
    caps = [tail_cap(left, max_read) for left in range(0, 512 << 20, 3 << 19)]
    assert all(c % PAGE == 0 and min(max_read, TAIL_MIN) <= c <= max_read for c in caps)
    assert caps == sorted(caps)                                  # (less left: never a longer read)
    assert tail_cap(1 << 40, max_read) == max_read and tail_cap(0, max_read) == min(max_read, TAIL_MIN)


def test_a_load_of_many_small_tensors_ends_with_short_reads_and_is_bitwise(tmp_path):
    g = torch.Generator().manual_seed(5)
    st = {f"w{i:03d}": torch.randn(64, 1024, generator=g) for i in range(160)}     # 40 MiB in 256 KiB tensors
    liferaft.save(tmp_path / "ck", st, options=liferaft.SaveOptions(compression="off"))
    storage = _storage(tmp_path / "ck")
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    liferaft.load(storage, target)
    assert all(torch.equal(target[k], st[k]) for k in st)
    data = [n for n in storage.reads if n >= PAGE * 4]
    full = batch_bytes(sum(v.numel() * 4 for v in st.values()), 32 << 20)
    assert sum(data) >= 40 << 20 and max(data) <= full + 2 * PAGE
    assert data[-1] <= TAIL_MIN + 2 * PAGE < full                # the last read: what follows the device is short
    assert data[-3:] == sorted(data[-3:], reverse=True)


class _Counted(PosixStorage):
    """A real folder, read from the device path (never streamed as RAM), counting its reads."""

    reads: list[int]

    @property
    def memory_speed(self) -> bool:  # type: ignore[override]
        return False

    def read_into(self, name, offset, out):
        self.reads.append(len(memoryview(out)))
        return super().read_into(name, offset, out)


def _state():
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(1000 + 37 * i, 640, generator=g) for i in range(6)}    # ~16 MiB in 6 tensors


def _storage(path):
    s = _Counted(str(path), direct_io=True, inflight=1)
    s.reads = []
    return s


def test_a_small_load_takes_several_reads_and_is_bitwise(tmp_path):
    st = _state()
    liferaft.save(tmp_path / "ck", st, options=liferaft.SaveOptions(compression="off"))
    total = sum(v.numel() * 4 for v in st.values())
    storage = _storage(tmp_path / "ck")
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    liferaft.load(storage, target)
    assert all(torch.equal(target[k], st[k]) for k in st)
    data = [n for n in storage.reads if n >= PAGE * 4]      # (the commit and manifest reads are small)
    limit = batch_bytes(total, 32 << 20)
    assert limit < total and len(data) >= 3
    assert max(data) <= limit + 2 * PAGE                     # (a read holds whole units: at most its pages more)


@pytest.mark.parametrize("which", [0, 5])
def test_a_flipped_byte_in_the_first_or_last_read_is_refused_and_named(tmp_path, which):
    st = _state()
    path = tmp_path / "ck"
    liferaft.save(path, st, options=liferaft.SaveOptions(compression="off"))
    key = f"w{which}"
    doc, _ = read_manifest(path)
    (c,) = next(t for t in doc["tensors"] if t["key"] == key)["chunks"]
    with open(path / c["file"], "r+b") as f:
        f.seek(c["byte_offset"] + c["length"] - 5)
        b = f.read(1)
        f.seek(c["byte_offset"] + c["length"] - 5)
        f.write(bytes([b[0] ^ 0x01]))
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    with pytest.raises(CorruptCheckpointError, match=key):
        liferaft.load(_storage(path), target)
    block = c["block_size"]
    last = (c["length"] - 5) // block * block                 # the damaged block: never landed
    assert not target[key].flatten()[last // 4:].any()
