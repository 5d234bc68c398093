"""Storage backends behind one interface (``base.Storage``) and the URL-scheme registry."""

from __future__ import annotations

import os
from collections.abc import Callable

from liferaft.errors import StorageError
from liferaft.storage.base import FileWriter, Storage
from liferaft.storage.files import walk
from liferaft.storage.memory import MemoryStorage
from liferaft.storage.posix import PosixStorage, fsync_dir

__all__ = ["FileWriter", "MemoryStorage", "PosixStorage", "Storage", "fsync_dir", "register_scheme", "resolve", "walk"]


def _s3(rest: str) -> Storage:
    from liferaft.storage.s3 import S3Storage  # imports the S3 client only when an s3:// URL is used

    return S3Storage(rest)


_SCHEMES: dict[str, Callable[[str], Storage]] = {
    "file": lambda rest: PosixStorage(rest),
    "memory": lambda rest: MemoryStorage(rest),
    "s3": _s3,
}


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Make ``scheme://rest`` URLs open ``factory(rest)``."""
    _SCHEMES[scheme] = factory


def resolve(path: str | os.PathLike[str] | Storage) -> Storage:
    """A Storage for a local path, a ``scheme://`` URL of a registered backend, or a Storage itself."""
    if isinstance(path, Storage):
        return path
    s = os.fspath(path)
    if "://" in s:
        scheme, rest = s.split("://", 1)
        factory = _SCHEMES.get(scheme)
        if factory is None:
            raise StorageError(f"{s!r}: no storage backend for scheme {scheme!r}; known: {sorted(_SCHEMES)}")
        if not rest:
            raise StorageError(f"{s!r}: the URL names no location")
        return factory(rest)
    if not s:
        raise StorageError("empty checkpoint path")
    return PosixStorage(s)
