"""Progress bars for long commands: bytes and ETA on a terminal (tqdm), nothing when stderr is not one."""

from __future__ import annotations

import sys
from typing import Any, Callable


class Progress:
    """``with Progress(total, "verify") as tick: ... tick(nbytes)``; silent unless stderr is a terminal."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.desc = total, desc
        self._bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False)
            return self._bar.update
        return lambda n: None

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()
