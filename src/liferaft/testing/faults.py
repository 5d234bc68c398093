"""Fault injection for tests of code that checkpoints (shipped for users too): POSIX storage whose data-file
writes fail, or wait for a gate, so that a test can hold a save in flight or make one rank's save fail.

Register one under a URL scheme with ``liferaft.storage.register_scheme("name", FailingStorage)`` (in each
rank's process; a rank may register a plain ``PosixStorage`` under the same name to stay healthy).
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from liferaft.storage.base import FileWriter
from liferaft.storage.posix import PosixStorage, _PosixWriter


class _FailingWriter(_PosixWriter):
    def pwrite(self, data: Any, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


class FailingStorage(PosixStorage):
    """Every positioned write to a data file raises ENOSPC; manifest and marker writes work."""

    def open_writer(self, name: str) -> FileWriter:
        path = self._p(name)
        self._mkdirs(path)
        return _FailingWriter(path)


class _GatedWriter(_PosixWriter):
    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def pwrite(self, data: Any, offset: int) -> None:
        if not self.gate.wait(60):
            raise TimeoutError("gated write: the gate was not opened within 60 s")
        super().pwrite(data, offset)


class GatedStorage(PosixStorage):
    """Data-file writes wait until ``GatedStorage.gate`` is set (class-wide; ``clear()`` it to close)."""

    gate = threading.Event()

    def open_writer(self, name: str) -> FileWriter:
        path = self._p(name)
        self._mkdirs(path)
        return _GatedWriter(path, self.gate)
