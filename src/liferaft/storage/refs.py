"""Reading an incremental checkpoint: names ``../<sibling>/<path>`` are files of a sibling checkpoint.

``with_references(storage)`` wraps the storage of one checkpoint so that the reading layers (which only see
manifest file names) reach referenced chunks through ``Storage.sibling`` (docs/FORMAT.md §4.2). Writes and
listings go to the checkpoint itself.
"""

from __future__ import annotations

from collections.abc import Callable

from liferaft.storage.base import FileWriter, Storage


class ReferencingStorage(Storage):
    """``inner`` for its own names; ``inner.sibling(s)`` for ``../s/<path>``."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.process_local = inner.process_local
        self.remote = inner.remote
        self.memory_speed = inner.memory_speed
        self.read_size = inner.read_size
        self._siblings: dict[str, Storage] = {}

    def route(self, name: str) -> tuple[Storage, str]:
        """The storage holding the file ``name`` and its name there."""
        if not name.startswith("../"):
            return self.inner, name
        sibling, _, rest = name[3:].partition("/")
        st = self._siblings.get(sibling)
        if st is None:
            st = self._siblings[sibling] = self.inner.sibling(sibling)
        return st, rest

    @property
    def url(self) -> str:
        return self.inner.url

    def open_writer(self, name: str) -> FileWriter:
        return self.inner.open_writer(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        st, rest = self.route(name)
        return st.read_into(rest, offset, out)

    def read_all(self, name: str, limit: int | None = None) -> bytes:
        st, rest = self.route(name)
        return st.read_all(rest, limit)

    def size(self, name: str) -> int:
        st, rest = self.route(name)
        return st.size(rest)

    def exists(self, name: str) -> bool:
        st, rest = self.route(name)
        return st.exists(rest)

    def list(self) -> list[str]:
        return self.inner.list()

    def has_files(self) -> bool:
        return self.inner.has_files()

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def put_atomic(self, name: str, data: bytes) -> None:
        self.inner.put_atomic(name, data)

    def sync(self) -> None:
        self.inner.sync()

    def lock_writer(self) -> Callable[[], None] | None:
        return self.inner.lock_writer()

    @property
    def place(self) -> str:
        return self.inner.place

    def sibling(self, name: str) -> Storage:
        return self.inner.sibling(name)

    def child(self, name: str) -> Storage:
        return self.inner.child(name)


def with_references(storage: Storage) -> Storage:
    """``storage`` able to read the ``../<sibling>/...`` names of an incremental checkpoint."""
    return storage if isinstance(storage, ReferencingStorage) else ReferencingStorage(storage)
