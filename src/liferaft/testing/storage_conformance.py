"""Conformance suite for storage backends: subclass ``StorageConformance`` and provide ``make_storage``.

Every backend (``liferaft.storage.base.Storage``) must pass it; liferaft's own backends do in
tests/unit/test_storage.py. Requires pytest.
"""

from __future__ import annotations

import pytest

from liferaft.errors import LiferaftError
from liferaft.storage.base import Storage


class StorageConformance:
    """Mix into a pytest test class; implement ``make_storage(self, tmp_path) -> Storage`` (a fresh, empty root)."""

    def make_storage(self, tmp_path) -> Storage:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    @pytest.fixture
    def st(self, tmp_path) -> Storage:
        return self.make_storage(tmp_path)

    def test_write_read_roundtrip_with_positioned_writes(self, st: Storage) -> None:
        w = st.open_writer("data/a/r0.bin")
        w.pwrite(b"world", 5)
        w.pwrite(memoryview(b"hello"), 0)
        w.close()
        w.close()  # idempotent
        assert st.read_all("data/a/r0.bin") == b"helloworld"
        assert st.size("data/a/r0.bin") == 10
        buf = bytearray(4)
        assert st.read_into("data/a/r0.bin", 3, memoryview(buf)) == 4 and bytes(buf) == b"lowo"

    def test_read_size_is_a_whole_number_of_pages_a_load_takes(self, st: Storage) -> None:
        # (the largest read a load asks by default: LoadOptions.max_read_bytes' range, whole pages)
        from liferaft.options import LoadOptions

        n = st.read_size
        assert type(n) is int and n % 4096 == 0
        assert LoadOptions(max_read_bytes=n).max_read_bytes == n

    def test_short_read_at_end_of_file(self, st: Storage) -> None:
        st.put_atomic("x", b"abc")
        buf = bytearray(10)
        assert st.read_into("x", 1, memoryview(buf)) == 2
        assert bytes(buf[:2]) == b"bc"

    def test_missing_names_raise_file_not_found(self, st: Storage) -> None:
        assert not st.exists("nope")
        for call in (lambda: st.read_all("nope"), lambda: st.size("nope"),
                     lambda: st.read_into("nope", 0, memoryview(bytearray(1)))):
            with pytest.raises(FileNotFoundError):
                call()
        st.delete("nope")  # not an error

    def test_read_all_with_a_limit_refuses_a_larger_file_before_reading_it(self, st: Storage) -> None:
        st.put_atomic("COMMIT", b"x" * 100)
        assert st.read_all("COMMIT", 100) == b"x" * 100 and st.read_all("COMMIT", None) == b"x" * 100
        with pytest.raises(LiferaftError, match="COMMIT"):
            st.read_all("COMMIT", 99)
        with pytest.raises(FileNotFoundError):
            st.read_all("nope", 10)
        st.put_atomic("empty", b"")
        assert st.read_all("empty", 0) == b""

    def test_has_files_says_whether_anything_is_there(self, st: Storage) -> None:
        assert not st.has_files()
        st.put_atomic("data/s/x", b"1")
        assert st.has_files() and st.child("data").has_files()
        st.delete("data/s/x")
        assert not st.has_files()

    def test_put_atomic_replaces(self, st: Storage) -> None:
        st.put_atomic("COMMIT", b"one")
        st.put_atomic("COMMIT", b"two!")
        assert st.read_all("COMMIT") == b"two!"
        st.sync()

    def test_list_and_delete(self, st: Storage) -> None:
        assert st.list() == []
        st.put_atomic("m.json", b"{}")
        w = st.open_writer("data/s/r00001.bin")
        w.pwrite(b"x", 0)
        w.close()
        assert st.list() == ["data/s/r00001.bin", "m.json"]
        st.delete("data/s/r00001.bin")
        assert st.list() == ["m.json"] and not st.exists("data/s/r00001.bin")

    def test_abort_leaves_nothing(self, st: Storage) -> None:
        w = st.open_writer("data/s/r0.bin")
        w.pwrite(b"partial", 0)
        w.abort()
        w.abort()
        assert not st.exists("data/s/r0.bin")

    def test_large_write_is_complete(self, st: Storage) -> None:
        blob = bytes(range(256)) * (3 * 4096 + 7)
        w = st.open_writer("big")
        w.pwrite(memoryview(blob), 0)
        w.close()
        assert st.size("big") == len(blob) and st.read_all("big") == blob

    def test_child_is_a_folder_view(self, st: Storage) -> None:
        c = st.child("step-1")
        c.put_atomic("COMMIT", b"c")
        w = c.open_writer("data/x/r0.bin")
        w.pwrite(b"abc", 0)
        w.close()
        assert c.list() == ["COMMIT", "data/x/r0.bin"] and c.read_all("data/x/r0.bin") == b"abc"
        assert st.list() == ["step-1/COMMIT", "step-1/data/x/r0.bin"] and st.read_all("step-1/COMMIT") == b"c"
        c.delete("COMMIT")
        assert st.list() == ["step-1/data/x/r0.bin"] and not c.exists("COMMIT")

    def test_sibling_is_the_folder_next_to_a_child(self, st: Storage) -> None:
        a = st.child("step-1")
        b = a.sibling("step-2")
        b.put_atomic("COMMIT", b"two")
        assert st.list() == ["step-2/COMMIT"] and b.read_all("COMMIT") == b"two"
        assert b.sibling("step-1").list() == [] and b.sibling("step-2").exists("COMMIT")

    def test_lock_writer_holds_the_folder_for_one_writer(self, st: Storage) -> None:
        from liferaft.errors import CheckpointBusyError

        folder = st.child("locked")
        release = folder.lock_writer()
        if release is None:                 # (a backend without a lock says so)
            return
        try:
            with pytest.raises(CheckpointBusyError):
                folder.lock_writer()
            other = st.child("other").lock_writer()      # another folder is free
            assert other is not None
            other()
        finally:
            release()
        again = folder.lock_writer()                     # free once released; release twice is harmless
        assert again is not None
        again()
        again()
