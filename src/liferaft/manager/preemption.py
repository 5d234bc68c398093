"""The process's preemption signal handlers, shared by every ``CheckpointManager`` that installed them.

Per signal: one handler (``PreemptionHandlers._dispatch``) and the events it sets, one per manager. The first
manager to install a signal keeps the handler it replaces; the last one to go puts it back, whatever the order
managers close in, unless something else replaced the dispatcher meanwhile (that one is then left alone). A signal
sets the event of every manager that installed it. Installing and restoring only from the main thread (where
Python runs signal handlers; ``signal.signal`` refuses elsewhere).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class PreemptionHandlers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, list[threading.Event]] = {}
        self._previous: dict[int, Any] = {}

    def _dispatch(self, signum: int, frame: Any) -> None:
        for event in list(self._events.get(signum, ())):
            event.set()

    def add(self, event: threading.Event, signals: tuple[int, ...]) -> None:
        """Set ``event`` on any of ``signals`` (all of them installed, or none and the error raised)."""
        with self._lock:
            added: list[int] = []
            try:
                for sig in signals:
                    if sig not in self._events:
                        self._previous[sig] = signal.signal(sig, self._dispatch)
                        self._events[sig] = []
                    self._events[sig].append(event)
                    added.append(sig)
            except BaseException:
                self._remove(event, added)
                raise

    def remove(self, event: threading.Event) -> None:
        """Stop setting ``event``; a signal nothing else waits for gets its previous handler back."""
        with self._lock:
            self._remove(event, [s for s, events in self._events.items() if event in events])

    def _remove(self, event: threading.Event, signals: list[int]) -> None:
        for sig in signals:
            events = self._events[sig]
            events.remove(event)
            if not events:
                del self._events[sig]
                previous = self._previous.pop(sig)
                if signal.getsignal(sig) == self._dispatch:
                    signal.signal(sig, previous)


#: the one registry of the process
preemption_handlers = PreemptionHandlers()

__all__ = ["PreemptionHandlers", "preemption_handlers"]
