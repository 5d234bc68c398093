"""What the integrations share: whether a folder holds a committed liferaft checkpoint."""

from __future__ import annotations

from liferaft.core.commit import read_commit
from liferaft.errors import LiferaftError
from liferaft.storage import resolve


def committed(path: str) -> bool:
    """Whether ``path`` holds a committed liferaft checkpoint: its ``COMMIT`` marker and the manifest it names read
    (capped, no link followed); anything unreadable is not one."""
    try:
        read_commit(resolve(path))
    except (LiferaftError, OSError):
        return False
    return True
