"""liferaft's own gloo groups: one per (process group, channel), made on first use, retired after a failure.

Metadata goes over gloo groups of liferaft's own (never the job's NCCL group). Their lifetime is boring on
purpose: one group per (process group, channel), made the first time it is used and reused after that. Each is a
``ProcessGroupGloo`` built directly on the job's store under a prefix that is never used twice in a job (the
group's ranks, its channel and a generation that only grows), so a group made after another was released or
broke can never meet the keys of an earlier one — the race that made ``new_group(..., use_local_synchronization=
True)`` after ``destroy_process_group`` hang in gloo's connectFullMesh. The groups are not registered with
torch.distributed (nothing of the job's own changes) and are shut down by :func:`release_groups` (which
``liferaft.release`` calls), or at interpreter exit (an ``atexit`` hook set when the first group is made) — never
left to the interpreter's teardown; ``CheckpointManager.close()`` leaves them for the next manager.

Process-wide state (all behind ``_LOCK``):

- ``_GROUPS``: (id of the parent process group, channel) → its live gloo group. Kept from first use until
  :func:`release_groups` (all, or one parent's), the group's failure (it is retired and replaced on next use),
  its parent's destruction (noticed on next use), or interpreter exit. A cached group holds its parent, so the
  id in the key cannot be reused by another group while the entry lives.
- ``_EPOCHS``: (ranks, channel) → the last epoch this process used. Never freed (a few bytes per group ever
  made): it is what keeps a name from ever being used twice in the job.
- ``_RETIRED``: groups replaced after a failure or a parent's destruction, closed by :func:`release_groups`
  (without argument) or at exit.

Caches above this package that are keyed by a group use :attr:`Coordinator.key` (the group's name, new for every
group made), never ``id()`` of a group, so they cannot match a group made later.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from liferaft.errors import DistributedError

T = TypeVar("T")


class Group:
    """One gloo backend of liferaft's: ``rank``/``size`` within it, ``ranks`` the global ranks of its members.

    ``name`` ends in the epoch from :func:`_next_epoch`."""

    def __init__(self, parent: Any, ranks: tuple[int, ...], name: str, timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.parent, self.ranks, self.size, self.name = parent, ranks, len(ranks), name
        self.rank = ranks.index(dist.get_rank())
        self.broken = False
        store = dist.PrefixStore(name + "/", c10d._get_default_store())
        try:
            self._backend: Any = dist.ProcessGroupGloo(store, self.rank, self.size,
                                                       datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - gloo reports a peer that never connects as RuntimeError
            raise DistributedError(
                f"making liferaft's gloo group {name} failed on rank {self.rank} of {self.size} (a peer died "
                f"or did not arrive within {timeout:.0f}s): {one_line(e)}") from None

    @property
    def backend(self) -> Any:
        """The gloo backend (DistributedError once the group is closed)."""
        if self._backend is None:
            raise DistributedError(f"liferaft's gloo group {self.name} was shut down (release_groups, a failure or "
                                   "the interpreter's exit)")
        return self._backend

    def fail(self) -> None:
        """A collective on this group failed: retire it now (its peers' pending operations fail at once)."""
        if not self.broken:
            self.broken = True
            self.close()

    def parent_alive(self) -> bool:
        import torch.distributed as dist

        try:
            dist.get_rank(self.parent)
            return True
        except (ValueError, RuntimeError):
            return False

    def close(self) -> None:
        """Shut the backend down and drop it: its C++ object (and its threads) goes now, not whenever the last
        holder of this group goes — a coordinator kept until the interpreter's teardown (a module-level manager)
        destroyed it there, after the exit hooks, and the process aborted ("terminate called without an active
        exception")."""
        backend, self._backend = self._backend, None
        if backend is not None:
            with contextlib.suppress(Exception):    # a group whose peers are gone may fail to shut down cleanly
                backend.shutdown()
        del backend


_LOCK = threading.Lock()
_GROUPS: dict[tuple[int, str], Group] = {}              # (id of the parent group, channel) → group
_EPOCHS: dict[tuple[tuple[int, ...], str], int] = {}     # (ranks, channel) → the last epoch used
_RETIRED: list[Group] = []
_HOOKED = False


def attempt(step: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``(step(), None)``, or ``(None, the exception)`` if it raised (anything: it is reported to every rank)."""
    try:
        return step(), None
    except BaseException as e:  # noqa: BLE001 - reported to every rank by the caller, then raised here too
        return None, e


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def group_for(pg: Any, timeout: float, channel: str) -> Group:
    """The group of ``channel`` over ``pg``'s ranks: the cached one, or a new one (collective over ``pg``)."""
    global _HOOKED
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(pg))
    key = (id(pg), channel)         # the group holds its parent, so the id is not reused while cached
    with _LOCK:
        group = _GROUPS.get(key)
        if group is not None and (group.broken or not group.parent_alive()):
            _retire(key)
            group = None
        if group is not None:
            return group
        if not _HOOKED:
            atexit.register(_release_all)
            _HOOKED = True
        base = f"liferaft/{hashlib.sha1(','.join(map(str, ranks)).encode()).hexdigest()[:16]}/{channel}"
        epoch = _next_epoch(base, _EPOCHS.get((ranks, channel), -1))
        _EPOCHS[(ranks, channel)] = epoch          # never used again, even if making the group fails
    group = Group(pg, ranks, f"{base}/{epoch}", timeout)
    with _LOCK:
        _GROUPS[key] = group
    return group


def _next_epoch(base: str, last: int) -> int:
    """The epoch of the next group named ``base``: one past ``last`` (the last this rank used), or the newer one
    another rank moved it to already. Agreed through the job's store (``compare_set``), so ranks that fell out of
    step after a failure meet again in the newest epoch, and no name is ever used twice in a job."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    try:
        epoch = int(store.compare_set(f"{base}/epoch", "" if last < 0 else str(last), str(last + 1)))
        if epoch <= last:           # no such key (a new store after the job's group was made again): start it
            epoch = int(store.compare_set(f"{base}/epoch", "", str(last + 1)))
        return epoch
    except Exception as e:  # noqa: BLE001 - the store's server is gone: the job's rendezvous is lost
        raise DistributedError(f"the job's store did not answer while making liferaft's gloo group {base}: "
                               f"{one_line(e)}") from None


def _retire(key: tuple[int, str]) -> None:
    group = _GROUPS.pop(key, None)
    if group is not None:
        _RETIRED.append(group)


def _release_all() -> None:
    with _LOCK:
        groups = list(_GROUPS.values()) + _RETIRED
        _GROUPS.clear()
        _RETIRED.clear()
    for group in groups:
        group.close()


def release_groups(process_group: Any = None) -> None:
    """Shut down the gloo groups liferaft made for ``process_group`` (default: every group it made). Optional:
    groups are also shut down at interpreter exit, and a later liferaft call simply makes new ones (under names
    never used before, so this is safe at any point between liferaft calls). Call it before
    ``destroy_process_group`` if you want the groups' sockets closed at that point."""
    import torch.distributed as dist

    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        _release_all()
        return
    with _LOCK:
        doomed = [k for k in _GROUPS if k[0] == id(process_group)]
        groups = [_GROUPS.pop(k) for k in doomed]
    for group in groups:
        group.close()


__all__ = ["Group", "attempt", "group_for", "one_line", "release_groups"]
