"""The storage backend contract: bytes and relative names, no tensors, no state.

A backend is rooted at one checkpoint (a directory or object prefix). Names are relative POSIX paths that
the caller has already checked (``format.check_relative_path``). Implementations: ``posix`` (local files),
``memory`` (process-local, the test double). Every backend passes ``liferaft.testing.storage_conformance``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from liferaft.errors import CorruptCheckpointError, StorageError

#: ``Storage.read_size`` unless a backend says otherwise: 32 MiB.
READ_SIZE = 32 << 20
#: ``Storage.read_size`` of a backend held in RAM (tmpfs, in-process): a load's scratch buffers are fresh
#: memory, first touched at ~1 GB/s on a VM, while RAM reads at memcpy speed (``tiers.memory`` restores).
RAM_READ_SIZE = 4 << 20
#: Bounds of a load's largest read (``LoadOptions.max_read_bytes``, ``Storage.read_size``): a page, and 64 GiB
#: (each scratch buffer a load allocates).
MIN_READ_BYTES, MAX_READ_BYTES = 4096, 64 << 30


def read_size_of(storage: Storage) -> int:
    """``storage.read_size``, checked: whole pages between ``MIN_READ_BYTES`` and ``MAX_READ_BYTES``, else a
    StorageError naming the backend (a backend's own value, not an option the caller passed)."""
    n = storage.read_size
    if type(n) is not int or not MIN_READ_BYTES <= n <= MAX_READ_BYTES or n % MIN_READ_BYTES:
        inner = getattr(storage, "inner", None)        # (a wrapper, ``storage.refs``: the backend it wraps)
        shown = type(inner if isinstance(inner, Storage) else storage).__name__
        raise StorageError(f"{shown} at {storage.url}: read_size must be a whole number of 4 KiB "
                           f"pages between {MIN_READ_BYTES} and {MAX_READ_BYTES} bytes (the largest read a load "
                           f"asks of it), not {n!r}; fix the backend, or pass LoadOptions(max_read_bytes=...)")
    return n


def check_limit(url: str, name: str, size: int, limit: int | None) -> None:
    """CorruptCheckpointError when the file ``name`` of ``size`` bytes is larger than ``limit`` (``read_all``)."""
    if limit is not None and size > limit:
        raise CorruptCheckpointError(f"{url}/{name} holds {size} bytes, more than the {limit} liferaft reads of such "
                                     "a file; it is damaged or not what its name says")


class FileWriter(ABC):
    """Writes one new file by positioned writes; ``close()`` makes its bytes durable."""

    @abstractmethod
    def pwrite(self, data: memoryview | bytes, offset: int) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Flush and make the file durable (fsync on POSIX). Idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Close without making durable and remove the partial file. Idempotent."""


class Storage(ABC):
    """One checkpoint location. All methods raise ``FileNotFoundError`` for a missing name."""

    #: True when the bytes live only in this process (other ranks cannot see them).
    process_local: bool = False
    #: True when reads cross a network to a shared service (object store): loads then share reads between ranks.
    remote: bool = False
    #: True when a read is a copy from RAM (tmpfs, an in-process store): no device latency to hide, so a load
    #: streams the bytes through a small buffer that stays in the CPU's cache (``core.chunks.memread``).
    memory_speed: bool = False
    #: The largest read a load asks of this storage unless ``LoadOptions.max_read_bytes`` says otherwise (the
    #: size of each of its scratch buffers). Large by default: a remote store splits a read into parallel
    #: requests (``S3Storage``: parts of ``part_size``). A local backend may answer smaller (``PosixStorage``).
    read_size: int = READ_SIZE

    @property
    @abstractmethod
    def url(self) -> str: ...

    @abstractmethod
    def open_writer(self, name: str) -> FileWriter:
        """Create (or truncate) ``name`` for writing, creating parent folders."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` into ``out``; return the count (short only at end of file)."""

    @abstractmethod
    def read_all(self, name: str, limit: int | None = None) -> bytes:
        """The whole file ``name``. With ``limit``, a file larger than ``limit`` bytes is refused (a
        ``LiferaftError`` naming it, ``CorruptCheckpointError`` by default) before any of it is read: a backend
        checks the size first (``fstat``, a HEAD), never reads a whole unbounded file to find out."""

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` is a file. A local backend refuses (``LiferaftError``) what is there but is not a
        regular file of this root: a link, a FIFO, a device, a folder."""

    @abstractmethod
    def list(self) -> list[str]:
        """Every file name under the root, recursively, sorted."""

    def has_files(self) -> bool:
        """Whether any file lies under the root; a backend may answer without listing everything (a local
        ``load('/')`` must not walk the disk)."""
        return bool(self.list())

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing name is not an error. Empty parent folders may be removed."""

    @abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small file so that readers see either the old content or all of ``data``, durably."""

    def lock_writer(self) -> Callable[[], None] | None:
        """Hold this folder for one writer (a save) until the returned release is called: CheckpointBusyError when
        another writer (another process, or another open of it in this one) holds it. None where the backend
        has no such lock (object stores: two saves to one prefix at once are not detected there)."""
        return None

    @abstractmethod
    def sync(self) -> None:
        """Make every file created or renamed so far durable as directory entries (fsync of folders)."""

    @property
    def place(self) -> str:
        """Where this storage's files are, resolved so that two storages with the same files have the same place
        (a local folder reached through a link, an alias of an object-store prefix): what tells a checkpoint's
        sibling from the checkpoint itself. This default: the URL."""
        return self.url

    def sibling(self, name: str) -> Storage:
        """A Storage rooted at ``name`` next to this one (same parent folder or prefix): where an incremental
        checkpoint's referenced chunks live (``../<name>/...`` in its manifest)."""
        raise NotImplementedError(f"{type(self).__name__} has no sibling storages")

    def child(self, name: str) -> Storage:
        """A Storage rooted at folder ``name`` under this one (whose ``list()`` shows its files as ``name/...``)."""
        raise NotImplementedError(f"{type(self).__name__} has no child storages")
