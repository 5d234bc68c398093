"""One entry point for every save path, so tests run the same assertions on each of them."""

from __future__ import annotations

from typing import Any

import liferaft

MODES = ["sync", "async-blocking", "async-overlapped", "async-waves"]


def save_with(mode: str, path: str, state: Any, **opts: Any) -> liferaft.SaveResult:
    """Save ``state`` by ``mode`` and return once the checkpoint is committed."""
    if mode == "sync":
        return liferaft.save(path, state, options=liferaft.SaveOptions(**opts))
    staging = "overlapped" if mode == "async-overlapped" else "blocking"
    if mode == "async-waves":
        opts.setdefault("memory_budget", 1 << 20)       # far smaller than the states the tests save
    handle = liferaft.async_save(path, state, options=liferaft.SaveOptions(staging=staging, **opts))
    handle.wait_staged()
    return handle.wait()
