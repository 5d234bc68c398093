"""argparse ``type=`` validators of the ``liferaft`` command's arguments: a bad value is a usage error (exit status
2, one line naming the argument), never a traceback."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any


def integer(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """An integer ≥ ``low`` (and ≤ ``high``) (``--keep-last 3``)."""
    def parse(text: str) -> int:
        if len(text) > 40:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}... ({len(text)} characters)")
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,}, got {value}")
        return value
    return parse


def number(low: float = 0.0, high: float = math.inf, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``above``: > ``low``); NaN and infinities refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            bound = f"> {low:g}" if above else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}"
                                             + (f" and <= {high:g}" if math.isfinite(high) else "")
                                             + f", got {text!r}")
        return value
    return parse


def integers(low: int = 1, high: int | None = None, most: int = 64) -> Callable[[str], list[int]]:
    """A comma list of at most ``most`` integers from ``low`` to ``high`` (``--gpus 1000,16000``); an empty item
    (``1,,2``, a trailing comma) is refused, not skipped."""
    one = integer(low, high)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",")]
        if not text.strip() or any(not x for x in items):
            raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers, got {text[:80]!r}")
        if len(items) > most:
            raise argparse.ArgumentTypeError(f"at most {most} numbers, got {len(items)}")
        return [one(x) for x in items]
    return parse


def regex(text: str) -> str:
    """A regular expression that compiles (``--rename '(' X`` is a usage error naming it)."""
    try:
        re.compile(text)
    except (re.error, RecursionError, OverflowError) as e:
        raise argparse.ArgumentTypeError(f"not a valid regular expression {text!r}: {e}") from None
    return text


class RenamePair(argparse.Action):
    """``--rename REGEX REPLACEMENT`` (repeatable, appended in order): a pair whose regex does not compile or whose
    replacement names a group the regex lacks is a usage error (exit status 2) naming it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        a, b = values
        try:
            re.compile(a).sub(b, "")
        except (re.error, RecursionError, OverflowError, IndexError) as e:
            parser.error(f"{option_string} {a!r} {b!r}: not a valid regular expression and replacement: {e}")
        pairs = list(getattr(namespace, self.dest, None) or [])
        pairs.append([a, b])
        setattr(namespace, self.dest, pairs)

