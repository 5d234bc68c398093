import os

import pytest

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
