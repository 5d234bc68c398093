"""Fault injection for tests of code that checkpoints (shipped for users too): POSIX storage whose data-file
writes fail, or wait for a gate, so that a test can hold a save in flight or make one rank's save fail; and
storage that kills its own process (``kill -9``) at a chosen operation, for crash tests.

Register one under a URL scheme with ``liferaft.storage.register_scheme("name", FailingStorage)`` (in each
rank's process; a rank may register a plain ``PosixStorage`` under the same name to stay healthy).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from liferaft.storage.base import FileWriter
from liferaft.storage.posix import PosixStorage, _PosixWriter


class _FailingWriter(_PosixWriter):
    def pwrite(self, data: Any, offset: int) -> None:
        if FailingStorage.active:
            raise OSError(FailingStorage.errno, f"{os.strerror(FailingStorage.errno)} (injected)")
        super().pwrite(data, offset)


class FailingStorage(PosixStorage):
    """While ``FailingStorage.active`` (class-wide, default True), every positioned write to a data file raises
    ``OSError(FailingStorage.errno)`` (default ENOSPC; EIO, EROFS, ... as a test needs); manifest and marker
    writes work. Switch ``active`` off to let the storage "recover"."""

    active: ClassVar[bool] = True
    errno: ClassVar[int] = errno.ENOSPC

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


class FlakyStorage(PosixStorage):
    """POSIX storage whose next ``FlakyStorage.failures`` atomic puts of a name containing ``FlakyStorage.match``
    fail with EIO (class-wide, per process), as a passing fault of the file system would. Child storages too."""

    match: ClassVar[str] = ""
    failures: ClassVar[int] = 0

    def put_atomic(self, name: str, data: bytes) -> None:
        cls = type(self)
        if cls.failures > 0 and cls.match in name:
            cls.failures -= 1
            raise OSError(errno.EIO, f"injected I/O error writing {name}")
        super().put_atomic(name, data)


@dataclass(frozen=True)
class CrashPlan:
    """Kill this process with SIGKILL at the ``nth`` (1-based) storage operation ``op`` ("pwrite", "put",
    "delete" or "read") on a name containing ``match``, ``when`` "before" or "after" the operation runs."""

    op: str
    match: str = ""
    nth: int = 1
    when: str = "before"


class CrashStorage(PosixStorage):
    """POSIX storage that ``kill -9``s its process when ``CrashStorage.plan`` says (class-wide, per process: set
    it in the process that should die, leave it None elsewhere). Child storages inherit the behaviour."""

    plan: ClassVar[CrashPlan | None] = None
    seen: ClassVar[int] = 0
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def arm(cls, plan: CrashPlan | None) -> None:
        with cls._lock:
            cls.plan, cls.seen = plan, 0

    @classmethod
    def _hit(cls, op: str, name: str, when: str) -> None:
        plan = cls.plan
        if plan is None or plan.op != op or plan.match not in name:
            return
        with cls._lock:
            if when == "before":
                cls.seen += 1
            if cls.seen == plan.nth and plan.when == when:
                os.kill(os.getpid(), signal.SIGKILL)

    def open_writer(self, name: str) -> FileWriter:
        path = self._p(name)
        self._mkdirs(path)
        return _CrashWriter(path, name, direct=self.direct_io)

    def put_atomic(self, name: str, data: bytes) -> None:
        self._hit("put", name, "before")
        super().put_atomic(name, data)
        self._hit("put", name, "after")

    def delete(self, name: str) -> None:
        self._hit("delete", name, "before")
        super().delete(name)
        self._hit("delete", name, "after")

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        self._hit("read", name, "before")
        n = super().read_into(name, offset, out)
        self._hit("read", name, "after")
        return n


class _CrashWriter(_PosixWriter):
    def __init__(self, path: str, name: str, direct: bool) -> None:
        super().__init__(path, direct=direct)
        self.name = name

    def pwrite(self, data: Any, offset: int) -> None:
        CrashStorage._hit("pwrite", self.name, "before")
        super().pwrite(data, offset)
        CrashStorage._hit("pwrite", self.name, "after")
