"""Collectives for metadata: work with no process group, raise every rank's error on every rank, time out.

Metadata goes over a gloo group made for it (never the NCCL group), created once per (group, timeout) and
cached, so that every exchange times out after ``timeout`` seconds whatever the job's own group uses. Each call exchanges
``(error or None, payload)``: if any rank failed, every rank raises — the failing rank its own exception,
the others a DistributedError naming the failed ranks and their errors.
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any

from liferaft.errors import DistributedError

_GLOO_GROUPS: dict[tuple[int, float], Any] = {}


def _gloo_group(pg: Any, timeout: float, channel: str) -> Any:
    import torch.distributed as dist

    cache_key = (id(pg), timeout, channel)
    group = _GLOO_GROUPS.get(cache_key)
    if group is not None:
        try:
            dist.get_rank(group)
        except (ValueError, RuntimeError):  # destroyed with its parent: make a new one
            group = None
    if group is None:
        ranks = dist.get_process_group_ranks(pg)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                               use_local_synchronization=True)
        _GLOO_GROUPS[cache_key] = group
    return group


def release_groups(process_group: Any = None) -> None:
    """Destroy the gloo groups liferaft made for ``process_group`` (default: the world): call it before
    ``destroy_process_group`` at the end of a job, so that no group of liferaft's outlives the job's own (a gloo
    group destroyed only by interpreter shutdown can abort the process). Later calls make new groups."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _GLOO_GROUPS.clear()
        return
    pg = process_group if process_group is not None else dist.group.WORLD
    for key in [k for k in _GLOO_GROUPS if k[0] == id(pg)]:
        group = _GLOO_GROUPS.pop(key)
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):      # already destroyed with its parent
            pass


class Coordinator:
    """The ranks of one save or load. ``rank``/``world`` are within ``process_group`` (default: the world).

    ``channel`` names an independent gloo group: the background thread of an async save uses "bg", so that its
    exchanges never interleave with those of the caller's thread ("fg"). Groups are created (collectively) the
    first time a channel is used, always from the caller's thread.
    """

    def __init__(self, process_group: Any = None, timeout: float = 600.0, channel: str = "fg") -> None:
        import torch.distributed as dist

        self.timeout = timeout
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise DistributedError("a process_group was given but torch.distributed is not initialized")
            self.rank, self.world, self.group = 0, 1, None
            return
        pg = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)
        self.group = _gloo_group(pg, timeout, channel) if self.world > 1 else None

    def exchange(self, payload: Any, error: BaseException | None = None, what: str = "") -> list[Any]:
        """All-gather ``payload`` from every rank; raise on every rank if any rank passed an ``error``."""
        if self.world == 1 or self.group is None:
            if error is not None:
                raise error
            return [payload]
        import torch.distributed as dist

        msg = None
        if error is not None:
            msg = f"{type(error).__name__}: {error}"
            if not isinstance(error, Exception) or type(error).__module__.split(".")[0] != "liferaft":
                msg += "\n" + "".join(traceback.format_exception(error)[-3:])
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, (msg, None if error is not None else payload), group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            if error is not None:
                raise error from e
            raise DistributedError(
                f"{what or 'collective'} failed on rank {self.rank} of {self.world} (a peer died or did not "
                f"arrive within {self.timeout:.0f}s): {e}") from None
        failed = [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]
        if failed:
            if error is not None:
                raise error
            lines = "\n".join(f"  rank {r}: {m}" for r, m in failed)
            raise DistributedError(f"{what or 'operation'} failed on {len(failed)} of {self.world} ranks:\n{lines}")
        return [p for _, p in gathered]

    def broadcast_from_zero(self, payload: Any, error: BaseException | None = None, what: str = "") -> Any:
        """Rank 0's ``payload`` on every rank (with the same error semantics as :meth:`exchange`)."""
        if self.world == 1 or self.group is None:
            if error is not None:
                raise error
            return payload
        import torch.distributed as dist

        msg = None if error is None else f"{type(error).__name__}: {error}"
        box = [(msg, payload if error is None else None)] if self.rank == 0 else [None]
        src = dist.get_global_rank(self.group, 0)
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise DistributedError(f"{what or 'broadcast'} failed on rank {self.rank}: {e}") from None
        m, p = box[0]
        if m is not None:
            if error is not None:
                raise error
            raise DistributedError(f"{what or 'operation'} failed on rank 0:\n  rank 0: {m}")
        return p

    def isend(self, tensor: Any, rank: int, tag: int) -> Any:
        """Start sending ``tensor`` to ``rank`` (of this coordinator) on its gloo group; returns the Work."""
        import torch.distributed as dist

        return dist.isend(tensor, dst=dist.get_global_rank(self.group, rank), group=self.group, tag=tag)

    def irecv(self, tensor: Any, rank: int, tag: int) -> Any:
        """Start receiving into ``tensor`` from ``rank``; returns the Work (``wait()`` raises on timeout)."""
        import torch.distributed as dist

        return dist.irecv(tensor, src=dist.get_global_rank(self.group, rank), group=self.group, tag=tag)
