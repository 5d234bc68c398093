"""Kept until the CLI moves to the public API (issue #15): see ``tools._source``."""

from liferaft.tools._source import NAMES, Source, check_source, detect, open_source  # noqa: F401
