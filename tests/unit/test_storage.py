import os

import pytest
import torch

from liferaft.errors import StorageError
from liferaft.storage import MemoryStorage, PosixStorage, register_scheme, resolve
from liferaft.storage.memory import drop_memory_store
from liferaft.testing.storage_conformance import StorageConformance


class TestPosix(StorageConformance):
    def make_storage(self, tmp_path):
        return PosixStorage(str(tmp_path / "root"))


class TestMemory(StorageConformance):
    def make_storage(self, tmp_path):
        name = f"conf-{os.getpid()}-{tmp_path.name}"
        drop_memory_store(name)
        return MemoryStorage(name)


def test_resolve_schemes(tmp_path):
    assert isinstance(resolve(tmp_path / "x"), PosixStorage)
    assert resolve(f"file://{tmp_path}/x").url == str(tmp_path / "x")
    assert isinstance(resolve("memory://abc"), MemoryStorage)
    with pytest.raises(StorageError, match="no storage backend for scheme 'gs'"):
        resolve("gs://bucket/x")
    register_scheme("mem2", lambda rest: MemoryStorage("mem2-" + rest))
    assert resolve("mem2://q").url == "memory://mem2-q"


def test_posix_put_atomic_leaves_no_temp_files(tmp_path):
    st = PosixStorage(str(tmp_path / "r"))
    for i in range(3):
        st.put_atomic("COMMIT", b"x" * i)
    assert st.list() == ["COMMIT"]


def test_posix_writer_uses_direct_io_for_aligned_pages_and_buffers_the_rest(tmp_path):
    from liferaft.staging.pool import BufferPool

    st = PosixStorage(str(tmp_path / "r"))
    pool = BufferPool(1 << 20)
    _, view = pool.acquire(3 * 4096 + 100, align=4096, phase=0)     # (on a page of memory, as its file range)
    view.copy_(torch.arange(view.numel()).to(torch.uint8))
    w = st.open_writer("d.bin")
    w.pwrite(b"head", 0)
    w.pwrite(memoryview(view.numpy()), 8192)          # 3 pages direct (where supported) + a 100-byte tail
    direct_used = w._dfd is not None
    w.close()
    data = st.read_all("d.bin")
    assert data[:4] == b"head" and data[8192:] == bytes(view.numpy())
    assert direct_used == st.direct_io                 # on file systems that allow O_DIRECT it was used
