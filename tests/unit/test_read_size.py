"""The largest read of a load: ``LoadOptions.max_read_bytes``, or by default the storage's ``read_size``.

A local disk reads fastest into small scratch buffers that stay in the CPU's cache (``storage.posix``), RAM too; an
object store splits a large read into parallel requests. The tests load through a ``PosixStorage`` that records
the size of every read it serves (the real reads, on real files).
"""

from __future__ import annotations

import os

import pytest
import torch

import liferaft
from liferaft.core.native import NativeReader
from liferaft.core.open import open_reader
from liferaft.errors import OptionsError, StorageError
from liferaft.options import LoadOptions, SaveOptions
from liferaft.storage import MemoryStorage, PosixStorage, memfs
from liferaft.storage.base import RAM_READ_SIZE, READ_SIZE
from liferaft.storage.posix import DISK_READ_SIZE
from liferaft.storage.refs import with_references


class _Recording(PosixStorage):
    """A ``PosixStorage`` that keeps the length of every ``read_into``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[int] = []

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        self.reads.append(len(memoryview(out).cast("B")))
        return super().read_into(name, offset, out)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # 24 MiB in one chunk (chunk_bytes 32 MiB below), and small tensors
    return {"big": torch.randn(6 << 20, generator=g), "small": torch.randn(1000, generator=g),
            "w": torch.randn(512, 300, generator=g)}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _disk_folder(tmp_path) -> str:
    if memfs.in_memory(str(tmp_path)):
        pytest.skip("the test folder is on a file system in RAM here")
    return str(tmp_path / "ck")


def test_each_backend_names_its_read_size(tmp_path):
    disk = _disk_folder(tmp_path)
    os.makedirs(disk)
    assert PosixStorage(disk).read_size == DISK_READ_SIZE == 8 << 20
    assert MemoryStorage("read-size-test").read_size == RAM_READ_SIZE == 4 << 20
    assert with_references(PosixStorage(disk)).read_size == DISK_READ_SIZE     # (the wrapper forwards it)
    if os.path.isdir("/dev/shm") and memfs.in_memory("/dev/shm"):
        assert PosixStorage("/dev/shm").read_size == RAM_READ_SIZE
    from liferaft.storage.s3 import S3Storage

    assert S3Storage("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1").read_size == READ_SIZE == 32 << 20


def test_options_take_none_or_a_size():
    assert LoadOptions().max_read_bytes is None
    assert LoadOptions(max_read_bytes=4096).max_read_bytes == 4096
    for bad in (0, 4095, True, 1.5, "8M", (64 << 30) + 1):
        with pytest.raises(OptionsError, match="max_read_bytes"):
            LoadOptions(max_read_bytes=bad)


def test_a_reader_resolves_the_default_from_its_storage(tmp_path):
    disk = _disk_folder(tmp_path)
    liferaft.save(disk, _state())
    reader = open_reader(disk, LoadOptions())
    try:
        assert isinstance(reader, NativeReader) and reader.options.max_read_bytes == DISK_READ_SIZE
    finally:
        reader.close()
    reader = open_reader(disk, LoadOptions(max_read_bytes=1 << 20))
    try:
        assert reader.options.max_read_bytes == 1 << 20
    finally:
        reader.close()


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("save", [SaveOptions(chunk_bytes=32 << 20, compression="off"), SaveOptions()],
                         ids=["one-32MiB-chunk", "default"])
def test_a_default_load_reads_at_most_the_storage_read_size(tmp_path, atomic, save):
    disk = _disk_folder(tmp_path)
    ref = _state()
    liferaft.save(disk, ref, options=save)
    st = _Recording(disk)
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    liferaft.load(st, got, options=LoadOptions(atomic=atomic))
    assert all(_bits(got[k]) == _bits(ref[k]) for k in ref)
    data = [n for n in st.reads if n > 64 << 10]    # (the data reads; the commit marker and manifest are small)
    # (a read is rounded out to whole pages: a range of 8 MiB that starts inside a page spans one more)
    assert len(data) >= 3 and max(data) <= DISK_READ_SIZE + 2 * 4096


class _BadSize(PosixStorage):
    read_size = 1024                # type: ignore[assignment]


class _MethodSize(PosixStorage):
    def read_size(self) -> int:     # type: ignore[override]
        return 8 << 20


@pytest.mark.parametrize("cls", [_BadSize, _MethodSize])
def test_a_backend_with_a_bad_read_size_is_named(tmp_path, cls):
    disk = _disk_folder(tmp_path)
    ref = _state()
    liferaft.save(disk, ref)
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    with pytest.raises(StorageError, match=f"{cls.__name__} at .*read_size must be"):
        liferaft.load(cls(disk), got)
    liferaft.load(cls(disk), got, options=LoadOptions(max_read_bytes=1 << 20))      # (not asked: not checked)
    assert all(_bits(got[k]) == _bits(ref[k]) for k in ref)


def test_large_hash_blocks_are_read_once_and_reads_stay_small(tmp_path):
    # a box of whole rows that starts inside a 4 MiB hash block of a 96 MiB chunk: cut anywhere, its pieces are
    # read as whole blocks, one more at each end than they need (pieces of about a block for 8 MiB reads: every
    # block read twice, 64 MiB for 32); cut on the block grid, each block once, in reads of at most 8 MiB
    rows, cols = 3 * 1024 * 8, 1024
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    disk = _disk_folder(tmp_path)
    liferaft.save(disk, {"w": full}, options=SaveOptions(compression="off", block_size=4 << 20,
                                                         chunk_bytes=128 << 20))
    lo = rows // 3 + 77
    part = torch.zeros(rows // 3, cols)
    st = _Recording(disk)
    res = liferaft.load(st, {"w": liferaft.Sharded(part, (rows, cols), (lo, 0))})
    assert torch.equal(part, full[lo:lo + rows // 3])
    assert res.bytes_read <= part.numel() * 4 + (4 << 20)          # (the two blocks it starts and ends in)
    assert max(n for n in st.reads if n > 64 << 10) <= DISK_READ_SIZE + 2 * 4096
    whole = torch.zeros(rows, cols)                                 # the same layout: reads as small
    st = _Recording(disk)
    liferaft.load(st, {"w": whole})
    assert torch.equal(whole, full)
    assert max(n for n in st.reads if n > 64 << 10) <= DISK_READ_SIZE + 2 * 4096


def test_an_explicit_max_read_bytes_wins(tmp_path):
    disk = _disk_folder(tmp_path)
    ref = _state()
    liferaft.save(disk, ref, options=SaveOptions(chunk_bytes=32 << 20, compression="off"))
    st = _Recording(disk)
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    liferaft.load(st, got, options=LoadOptions(max_read_bytes=32 << 20))
    assert all(_bits(got[k]) == _bits(ref[k]) for k in ref)
    assert max(st.reads) > DISK_READ_SIZE           # (the 24 MiB chunk in one read)


def test_verify_takes_none_as_the_default_and_checks_a_size(tmp_path):
    disk = _disk_folder(tmp_path)
    liferaft.save(disk, _state(), options=SaveOptions(chunk_bytes=32 << 20, compression="off"))
    report = liferaft.verify(disk)
    assert report.bytes_checked >= 24 << 20
    with pytest.raises(OptionsError, match="max_read_bytes"):
        liferaft.verify(disk, max_read_bytes=0)
