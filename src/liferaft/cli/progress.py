"""Progress bars of the `liferaft` command: bytes and ETA on a terminal (tqdm), nothing when stderr is not one."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Self

from liferaft.storage import walk


class Progress:
    """``with Progress(total, "verify") as tick: ... tick(nbytes)``; silent unless stderr is a terminal. ``total``
    may be a function, called only when the bar shows (what it costs — reading a manifest of 100k keys takes
    seconds — is not paid for a bar nobody sees)."""

    def __init__(self, total: int | Callable[[], int], desc: str, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.desc = total, desc
        self._bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if self.enabled:
            from tqdm import tqdm

            total = self.total() if callable(self.total) else self.total
            self._bar = tqdm(total=total or None, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False)
            return self._bar.update
        return lambda n: None

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


class FolderGrowth:
    """``with FolderGrowth(path, tick): ...`` calls ``tick(bytes)`` with the growth of the files under the local
    folder or file ``path`` every 0.2 s while the block runs (progress of a writer that has no hook of its own)."""

    def __init__(self, path: str, tick: Callable[[int], None]) -> None:
        self.path, self.tick = path, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liferaft-progress", daemon=True)
        self._seen = 0

    def _size(self) -> int:
        if os.path.isfile(self.path):
            return os.path.getsize(self.path)
        total = 0
        for folder, _, files in walk(self.path):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(folder, f))
                except OSError:
                    pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._report()

    def _report(self) -> None:
        now = self._size()
        if now > self._seen:
            self.tick(now - self._seen)
            self._seen = now

    def __enter__(self) -> Self:
        if "://" not in self.path:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._report()
