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

from liferaft.errors import OptionsError
from liferaft.manager.options import PreemptionOptions


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


class Preemption:
    """One manager's preemption signals (``PreemptionOptions``): whether one arrived (``signalled``), whether the
    handlers are installed, or wanted (asked for on a thread that cannot install them: the ranks still vote)."""

    def __init__(self, options: PreemptionOptions) -> None:
        self.options = options
        self._event = threading.Event()
        self.installed = False                  # this manager is in the handler chain of its signals
        self.wanted = False                     # installed (or asked for) on every rank: maybe_save agrees

    @property
    def signalled(self) -> bool:
        return self._event.is_set()

    def install(self) -> None:
        """Install the handlers now (main thread only: OptionsError elsewhere); idempotent."""
        if not self.options.signals or self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise OptionsError("handle_preemption() installs signal handlers: call it from the main thread")
        preemption_handlers.add(self._event, self.options.signals)
        self.installed = self.wanted = True

    def at_first_save(self) -> None:
        """At ``maybe_save`` with ``install="first_save"``: install from the main thread; elsewhere only want them."""
        if self.options.install != "first_save" or self.installed or not self.options.signals:
            return
        if threading.current_thread() is threading.main_thread():
            self.install()
        else:
            self.wanted = True

    def remove(self) -> None:
        """Put the previous handlers back (``PreemptionHandlers``: any number of managers, closed in any order)."""
        if self.installed:
            preemption_handlers.remove(self._event)
            self.installed = False


__all__ = ["Preemption", "PreemptionHandlers", "preemption_handlers"]
