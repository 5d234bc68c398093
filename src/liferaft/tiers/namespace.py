"""Exclusive locks of shared-memory namespaces: one live process per rank of a memory tier's namespace (two jobs
given the same ``MemoryTier`` job id on one node must not save into it at once) and one live writer per rank of a
per-step log (``tiers.stepcheck.lock_writer``).

A lock is an exclusive ``flock`` on a small file, held through one descriptor until it is closed or the process
ends (the kernel frees it; a kill -9 included). A child made by ``fork`` (a DataLoader worker) would share that
descriptor's lock and keep it past its parent's death, refusing the restarted rank while it lives: in a forked
child every lock descriptor is pointed at ``/dev/null`` (``os.register_at_fork``, registered at the first lock,
never at import), so the child holds none and its copies of the descriptor numbers stay harmless to close.

The memory tier's lock files live apart from the namespace (``<base>/.locks/<job>/<node>/rank-<r>.lock``): a
``release()``, which removes the node's namespace folder, must not remove the lock files other live ranks hold
(a new file at the same path would let a second job in). A tier made again in the same process keeps holding its
rank's lock; a forked child holds none. Sequential use of a job id (``srun`` steps of one allocation) is allowed,
as docs/TIERS.md says; concurrent use is refused with CheckpointBusyError naming the namespace, before anything
there changes.
"""

from __future__ import annotations

import fcntl
import os
import threading

_LOCK = threading.Lock()            # held across every open, lock and close below, and across a fork
_FDS: set[int] = set()              # every lock descriptor this process holds (pointed at /dev/null in a child)
_HELD: dict[str, tuple[int, int]] = {}      # memory-tier lock path -> (descriptor, the pid that took it)
_registered = False


def _before_fork() -> None:
    _LOCK.acquire()                 # (no descriptor is half taken or half let go while the process forks)


def _after_fork_in_parent() -> None:
    _LOCK.release()


def _after_fork_in_child() -> None:
    """In a child made by ``fork``: let go of the parent's locks without closing the parent's (shared) lock."""
    global _LOCK
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in _FDS:
            try:
                os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)
    _FDS.clear()
    _HELD.clear()
    _LOCK = threading.Lock()        # (the parent's was held by the forking thread)


def exclusive(path: str) -> int | None:
    """An exclusive lock on ``path`` (created if missing, never through a link) as a descriptor, or None when
    another live process (or another descriptor of this one) holds it. OSError when the file cannot be opened."""
    global _registered
    with _LOCK:
        if not _registered:
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
            _registered = True
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        _FDS.add(fd)
    return fd


def let_go(fd: int) -> None:
    """Close a descriptor ``exclusive`` returned (its lock with it)."""
    with _LOCK:
        _FDS.discard(fd)
        os.close(fd)


LOCKS = ".locks"                    # the folder of the locks under a tier's base (no job id may be named so)


def locks_of(base: str, job_id: str, node: str) -> str:
    """The folder of the locks of the memory-tier namespace ``base/job_id/node`` (and of its per-step logs)."""
    return os.path.join(base, LOCKS, job_id, node)


def _tier_lock(base: str, job_id: str, node: str, rank: int) -> str:
    return os.path.join(locks_of(base, job_id, node), f"rank-{rank}.lock")


def hold(base: str, job_id: str, node: str, rank: int) -> str | None:
    """Take (or keep) this process's lock of ``rank`` in the memory-tier namespace ``base/job_id/node``; None when
    held, else why not (another live process holds it, or the lock file cannot be made: what the caller raises on
    every rank)."""
    path = _tier_lock(base, job_id, node, rank)
    with _LOCK:
        if _HELD.get(path, (-1, -1))[1] == os.getpid():
            return None
    where = os.path.join(base, job_id, node)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = exclusive(path)
    except OSError as e:
        return f"{where}: the lock of rank {rank} of this memory-tier namespace ({path}) cannot be made: {e}"
    if fd is None:
        return (f"{where}: rank {rank} of this memory-tier namespace is in use by another live process: two jobs "
                "given the same MemoryTier job id on one node must not run at once (their saves would remove and "
                "publish each other's files); give each its own job id")
    with _LOCK:
        _HELD[path] = (fd, os.getpid())
    return None
