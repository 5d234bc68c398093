"""Making the job's process group under torchrun so that a restarted job never meets its predecessors' keys
(``init_process_group``), the incarnation agreed through torchrun's store (``_agree_incarnation``)."""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any

from liferaft.errors import DistributedError


def _one_line(e: BaseException) -> str:
    """An error's message on one line, at most 500 characters (for the error this module raises)."""
    return " ".join(str(e).split())[:500]


def init_process_group(backend: str | None = None, *, timeout: float | None = None, incarnation: str | None = None,
                       **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for a job that torchrun may restart (``--max-restarts``).

    torch 2.x keeps one store for the workers across torchrun's restarts and does not separate the incarnations'
    keys (pytorch/pytorch#135712): restarted workers read the addresses their dead predecessors left and their
    gloo group hung (an NCCL group can read a stale unique id the same way). Under torchrun (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` set) the job's group is
    made on torchrun's store under a prefix of this incarnation, so no incarnation meets another's keys; liferaft's
    own gloo groups are made on the same store and kept apart the same way.

    The ranks agree on their incarnation through the store (``_agree_incarnation``: each names itself by a fresh
    random nonce, rank 0 has each nonce confirmed by the live process that wrote it, then hands every rank a name
    made of them all), so they agree whatever each node's agent counts (``TORCHELASTIC_RESTART_COUNT`` is per agent: a
    node that restarts its workers for a membership change, or a replacement node, counts otherwise), whatever
    the world was before (it shrank, or grew back), and whatever earlier workers left in the store (one that died
    before this call). ``incarnation`` (any string the ranks share) skips the agreement. Outside torchrun it is
    ``torch.distributed.init_process_group(backend)`` (``env://``). ``timeout`` (seconds, for the agreement too)
    and ``kwargs`` (``device_id``, ``pg_options``, ...) go to torch's call; ``rank``, ``world_size``, ``store`` and
    ``init_method`` are this function's to set under torchrun (OptionsError)."""
    import os

    import torch.distributed as dist

    from liferaft.errors import OptionsError

    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env and incarnation is None:
        dist.init_process_group(backend, **kwargs)
        return
    taken = sorted({"rank", "world_size", "store", "init_method"} & set(kwargs))
    if taken:
        raise OptionsError(f"liferaft.init_process_group sets {', '.join(taken)} itself under torchrun (from "
                           "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); do not pass them")
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        addr = env["MASTER_ADDR"]
        if not (0 <= rank < world and 0 < port < 1 << 16 and addr):
            raise ValueError(f"RANK={rank} WORLD_SIZE={world} MASTER_PORT={port} MASTER_ADDR={addr!r} out of range")
    except (KeyError, ValueError) as e:
        raise OptionsError(f"liferaft.init_process_group: torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                           f"must be set (integers but the address): {type(e).__name__} {e}") from None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True"
    store = dist.TCPStore(addr, port, world_size=world, is_master=not agent and rank == 0, multi_tenant=not agent,
                          timeout=kwargs.get("timeout", datetime.timedelta(minutes=30)))
    if incarnation is None:
        wait = kwargs.get("timeout", datetime.timedelta(minutes=30)).total_seconds()
        incarnation = _agree_incarnation(store, rank, world, wait)
    prefixed = dist.PrefixStore(f"liferaft/incarnation-{incarnation}/", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, **kwargs)


def _agree_incarnation(store: Any, rank: int, world: int, timeout: float) -> str:
    """A name for this incarnation of the job that every rank of it gets and no other incarnation does, agreed
    through ``store`` (torchrun's, which outlives the workers and holds what earlier incarnations wrote).

    Every rank writes a fresh random nonce under its rank (``hello/rank-<r>``). Rank 0 reads them all (one
    ``multi_get``); a nonce it reads may be a dead predecessor's, so it asks each nonce's owner a question named by
    the nonce and holding rank 0's own nonce and the world size (``ask/<nonce>``: only a live process waits on its
    own nonce's question), and counts the answers on a counter named by its own nonce (``acks/<rank 0's nonce>``: no
    answer of an earlier incarnation counts). When every other rank has answered, their nonces as read then are all
    fresh (each wrote it before it answered), and rank 0 gives each (``final/<nonce>``) the name: a digest of them
    all. A few store round trips per pass on rank 0, whatever the world size; the others block on the store.
    DistributedError within ``timeout`` seconds: naming the ranks that did not join, or saying that this process
    was started for another world size than rank 0's (a worker left from an earlier incarnation)."""
    import uuid

    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    try:
        store.set(f"liferaft/hello/rank-{rank}", nonce)
        if rank != 0:
            store.wait([f"liferaft/ask/{nonce}"], left())
            asker, _, size = store.get(f"liferaft/ask/{nonce}").decode().partition(":")
            if size != str(world):
                raise DistributedError(f"liferaft.init_process_group: rank 0 runs a world of {size} processes, this "
                                       f"one (rank {rank}) was started for {world}: a worker of another incarnation?")
            store.add(f"liferaft/acks/{asker}", 1)
            store.wait([f"liferaft/final/{nonce}"], left())
            return store.get(f"liferaft/final/{nonce}").decode()
        keys = [f"liferaft/hello/rank-{r}" for r in range(1, world)]
        asked: set[str] = set()
        pause = 0.002
        while keys:
            if store.check(keys):                   # (every rank wrote a nonce once: maybe a dead one's)
                theirs = [v.decode() for v in store.multi_get(keys)]
                new = [n for n in theirs if n not in asked]
                if new:
                    store.multi_set([f"liferaft/ask/{n}" for n in new], [f"{nonce}:{world}"] * len(new))
                    asked.update(new)
                if store.add(f"liferaft/acks/{nonce}", 0) >= len(keys):
                    theirs = [v.decode() for v in store.multi_get(keys)]     # (all fresh now)
                    break
            if time.monotonic() > deadline:
                late = [r for r, k in enumerate(keys, 1) if not store.check([k])] or list(range(1, world))
                raise DistributedError(f"liferaft.init_process_group: ranks {late[:20]} of {world} did not join "
                                       f"within {timeout:.0f} s (not started, or died)")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        else:
            theirs = []
        name = hashlib.sha1(",".join([nonce, *theirs]).encode()).hexdigest()[:16]
        if theirs:
            store.multi_set([f"liferaft/final/{n}" for n in theirs], [name] * len(theirs))
        return name
    except DistributedError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's timeout or a lost store server
        raise DistributedError(f"liferaft.init_process_group: rank {rank} could not agree on the incarnation "
                               f"through torchrun's store within {timeout:.0f} s: {_one_line(e)}") from None
