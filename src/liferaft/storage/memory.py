"""In-memory storage: the test double. Process-local: ``memory://name`` is shared by all uses in one process."""

from __future__ import annotations

import threading

from liferaft.storage.base import RAM_READ_SIZE, FileWriter, Storage, check_limit

_LOCK = threading.Lock()
_STORES: dict[str, dict[str, bytearray]] = {}


class _MemWriter(FileWriter):
    def __init__(self, files: dict[str, bytearray], name: str) -> None:
        self.files, self.name = files, name
        self.buf: bytearray | None = bytearray()

    def pwrite(self, data: memoryview | bytes, offset: int) -> None:
        assert self.buf is not None, "writer is closed"
        mv = memoryview(data).cast("B")
        end = offset + len(mv)
        if len(self.buf) < end:
            self.buf.extend(b"\0" * (end - len(self.buf)))
        self.buf[offset:end] = mv

    def close(self) -> None:
        if self.buf is not None:
            with _LOCK:
                self.files[self.name] = self.buf
            self.buf = None

    def abort(self) -> None:
        self.buf = None


class MemoryStorage(Storage):
    """``memory://top/sub``: the files under ``sub/`` of the in-process store ``top`` (a child is a prefix view)."""

    process_local = True
    memory_speed = True
    read_size = RAM_READ_SIZE

    def __init__(self, name: str) -> None:
        self.name = name.strip("/")
        top, _, rest = self.name.partition("/")
        self._top = top
        self._prefix = f"{rest}/" if rest else ""

    @property
    def files(self) -> dict[str, bytearray]:
        """The top store's files (keys include this storage's prefix); reading a store never written creates nothing."""
        with _LOCK:
            return _STORES.get(self._top, {})

    def _writable(self) -> dict[str, bytearray]:
        with _LOCK:
            return _STORES.setdefault(self._top, {})

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def child(self, name: str) -> MemoryStorage:
        return MemoryStorage(f"{self.name}/{name}")

    def sibling(self, name: str) -> MemoryStorage:
        parent = self.name.rpartition("/")[0]
        if not parent:
            raise NotImplementedError(f"{self.url} is a whole store; it has no siblings")
        return MemoryStorage(f"{parent}/{name}")

    def _get(self, name: str) -> bytearray:
        try:
            return self.files[self._prefix + name]
        except KeyError:
            raise FileNotFoundError(f"{self.url}/{name}") from None

    def open_writer(self, name: str) -> FileWriter:
        return _MemWriter(self._writable(), self._prefix + name)

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        buf = self._get(name)
        mv = memoryview(out).cast("B")
        chunk = buf[offset:offset + len(mv)]
        mv[:len(chunk)] = chunk
        return len(chunk)

    def read_all(self, name: str, limit: int | None = None) -> bytes:
        buf = self._get(name)
        check_limit(self.url, name, len(buf), limit)
        return bytes(buf)

    def size(self, name: str) -> int:
        return len(self._get(name))

    def exists(self, name: str) -> bool:
        return self._prefix + name in self.files

    def list(self) -> list[str]:
        n = len(self._prefix)
        with _LOCK:
            return sorted(k[n:] for k in _STORES.get(self._top, {}) if k.startswith(self._prefix))

    def delete(self, name: str) -> None:
        files = self.files
        with _LOCK:
            files.pop(self._prefix + name, None)

    def put_atomic(self, name: str, data: bytes) -> None:
        files = self._writable()
        with _LOCK:
            files[self._prefix + name] = bytearray(data)

    def sync(self) -> None:
        pass


def drop_memory_store(name: str) -> None:
    """Forget everything stored under ``memory://name`` in this process."""
    top, _, rest = name.strip("/").partition("/")
    with _LOCK:
        if not rest:
            _STORES.pop(top, None)
            return
        files = _STORES.get(top, {})
        for k in [k for k in files if k.startswith(rest + "/")]:
            del files[k]
