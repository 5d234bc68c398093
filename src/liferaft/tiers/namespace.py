"""One live process per rank of a memory-tier namespace: two jobs given the same ``MemoryTier`` job id on one node
(two experiments, two launches) must not save into it at once.

Each rank holds an exclusive ``flock`` on ``<namespace>/.rank-<r>.lock`` from its tier's construction until its
process ends (the kernel frees it; a kill -9 included). A process holds it once: a tier made again in the same
process (a manager re-created after a failure) keeps holding it. Sequential use of a job id (``srun`` steps of one
allocation) is allowed, as documented in docs/TIERS.md; concurrent use is refused with CheckpointBusyError naming
the namespace, before anything there changes.
"""

from __future__ import annotations

import fcntl
import os
import threading

_HELD: dict[str, int] = {}          # lock path -> descriptor, held until the process ends
_LOCK = threading.Lock()


def hold(namespace: str, rank: int) -> str | None:
    """Take (or keep) this process's lock of ``rank`` in ``namespace`` (created if missing); None when held, else
    why not (another live process holds it)."""
    path = os.path.join(namespace, f".rank-{rank}.lock")
    with _LOCK:
        if path in _HELD:
            return None
        os.makedirs(namespace, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return (f"{namespace}: rank {rank} of this memory-tier namespace is in use by another live process: two "
                    "jobs given the same MemoryTier job id on one node must not run at once (their saves would "
                    "remove and publish each other's files); give each its own job id")
        _HELD[path] = fd
        return None


def let_go(namespace: str, rank: int) -> None:
    """Release this process's lock of ``rank`` in ``namespace`` (``MemoryTier.release``: the namespace is gone)."""
    path = os.path.join(namespace, f".rank-{rank}.lock")
    with _LOCK:
        fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)
