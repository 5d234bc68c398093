"""What the ``liferaft`` command prints: text from untrusted checkpoints made safe for a terminal."""

from __future__ import annotations

import io
from typing import TextIO


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or hide escaped as Python escapes it (``\\x1b``,
    ``\\u202e``): control characters but newline and tab, format characters (bidi overrides, zero-width ones), line
    and paragraph separators. Keys, paths and messages come from untrusted checkpoints: printed raw, an escape
    sequence could set the terminal's title, conceal text or reorder a line."""
    if text.replace("\n", "").replace("\t", "").isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class PrintableOutput(io.TextIOBase):
    """A text stream that writes to ``inner`` what ``printable`` makes of it (the command's standard output)."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        self.inner.write(printable(text))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")
