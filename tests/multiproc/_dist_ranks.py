"""Rank functions for collective failure tests (imported as ``multiproc._dist_ranks``)."""

from __future__ import annotations

import time
from typing import Any

import torch

import liferaft


def hang_on_second_save(rank: int, world: int, path: str) -> str:
    opts = liferaft.SaveOptions(timeout=3.0, overwrite=True)
    liferaft.save(path, {"w": torch.ones(4)}, options=opts)      # warm: both ranks present
    if rank == 1:
        time.sleep(10)                                           # a rank that stops answering
        return "slept"
    try:
        liferaft.save(path, {"w": torch.zeros(4)}, options=opts)
    except liferaft.DistributedError as e:
        return f"DistributedError: {e}"
    return "no error"


def p2p_after_a_peer_died(rank: int, world: int, out: str) -> None:
    """Rank 1 kill -9s itself once the group is made; rank 0 then keeps sending to it (and receiving from it) until
    one of those fails: it must fail as a DistributedError (a failure to post the send included: gloo raises a raw
    RuntimeError there once the peer's connection is closed), and the group is then marked broken. Rank 0 writes
    ``out`` with what it saw."""
    import json
    import os
    import signal

    from liferaft.dist import Coordinator

    coord = Coordinator(timeout=5.0, channel="p2p-test")
    coord.exchange(rank, None, "made")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    seen = "no error"
    try:
        for _ in range(200):
            coord.isend(torch.ones(1024), 1, 0).wait()
            time.sleep(0.01)
    except Exception as e:  # noqa: BLE001 - reported to the test
        seen = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump({"seen": seen, "broken": bool(coord.group is not None and coord.group.broken)}, f)


def scatter(rank: int, world: int, fail: bool) -> list[str]:
    """Two scatters from rank 0 (each rank a message of its own size, one empty), then one where rank 0 fails
    (``fail``), then a last one: what each rank received, or the error it raised."""
    from liferaft.dist import Coordinator

    coord = Coordinator(timeout=30)
    out = []
    for i in range(2):
        msgs = [("x" * (r * 1000 + i) if r != 1 else "") for r in range(world)] if rank == 0 else None
        out.append(str(len(coord.scatter_from_zero(msgs, None, "scatter"))))
    try:
        err = ValueError("no base here") if fail and rank == 0 else None
        out.append(str(coord.scatter_from_zero([rank] * world if rank == 0 else None, err, "scatter")))
    except Exception as e:  # noqa: BLE001 - reported
        out.append(f"{type(e).__name__}: {e}")
    out.append(str(coord.scatter_from_zero(list(range(world)) if rank == 0 else None, None, "scatter")))
    return out


def alike(rank: int, world: int) -> tuple[int, ...]:
    """The ranks whose value equals this rank's, values: 0 for ranks 0 and 3, 7 for the others (a large id)."""
    from liferaft.dist import Coordinator

    return Coordinator(timeout=30).peers_alike(0 if rank in (0, 3) else (1 << 61) + 7, "alike")


def sizes_across_the_first_round(rank: int, world: int) -> list[tuple[str, int, str, int, bool]]:
    """All-gather and broadcast messages of every length around what the first round carries, with the default
    head and with a small one (``HEAD_TOTAL`` as a large world has it), the ranks' lengths alike, each its own,
    or only rank 0's large: (head, length, kind, rounds taken, whether every rank's bytes arrived exactly)."""
    import random

    import liferaft.dist.wire as W
    from liferaft.dist import Coordinator

    def payload(n: int, kind: str, r: int) -> bytes:
        length = {"alike": n, "own": n + 17 * r, "zero": n if r == 0 else 0}[kind]
        return random.Random(f"{n}/{kind}/{r}").randbytes(length)

    c = Coordinator()
    assert c.group is not None
    real = c.group._backend
    rounds = [0]

    class Counting:         # (the real gloo backend, its collectives counted)
        def allgather(self, *a: Any) -> Any:
            rounds[0] += 1
            return real.allgather(*a)

        def broadcast(self, *a: Any) -> Any:
            rounds[0] += 1
            return real.broadcast(*a)

    out = []
    total = W.HEAD_TOTAL
    try:
        c.group._backend = Counting()
        for head_total in (total, 256 * world):
            W.HEAD_TOTAL = head_total
            room = W.head_size(world) - W.LEN
            for n in (0, 1, room - 17, room - 1, room, room + 1, 2 * room, 3 << 20):
                for kind in ("alike", "own", "zero"):
                    rounds[0] = 0
                    got = c._allgather_bytes(payload(n, kind, rank))
                    out.append((f"allgather head {room + W.LEN}", n, kind, rounds[0],
                                got == [payload(n, kind, r) for r in range(world)]))
        room = W.BROADCAST_HEAD - W.LEN
        for n in (0, 1, room - 1, room, room + 1, 2 * room, 3 << 20):
            rounds[0] = 0
            sent = c._broadcast_bytes(payload(n, "zero", 0) if rank == 0 else b"")
            out.append(("broadcast", n, "zero", rounds[0], sent == payload(n, "zero", 0)))
    finally:
        W.HEAD_TOTAL = total
        c.group._backend = real
    return out


def forged_lengths(rank: int, world: int) -> list[str]:
    """Rank 1 (rank 0 for a broadcast) announces a length past the limits in a collective's first round (its
    head forged after the real framing made it): every rank refuses it alike, before allocating, and the group
    still works after."""
    import numpy as np

    import liferaft.dist.coordinator as C
    import liferaft.dist.wire as W
    from liferaft.dist import Coordinator
    from liferaft.errors import DistributedError

    c = Coordinator(timeout=30)
    real = C.head_tensor
    out = []
    cases = [("allgather", 1, 1 << 62), ("allgather", 1, W.MAX_MESSAGE + 1),
             ("allgather", 1, W.MAX_RECEIVED // world + 1), ("broadcast", 0, 1 << 40)]
    for kind, liar, n in cases:
        def forged(data: Any, size: int, _n: int = n) -> Any:
            t = real(data, size)
            t.numpy()[:W.LEN] = np.frombuffer(_n.to_bytes(W.LEN, "little"), dtype=np.uint8)
            return t

        if rank == liar:
            C.head_tensor = forged
        try:
            if kind == "allgather":
                c._allgather_bytes(b"abc")
            else:
                c._broadcast_bytes(b"abc")
            out.append("accepted")
        except DistributedError as e:
            out.append(str(e))
        finally:
            C.head_tensor = real
    if rank == 1:                           # through the public exchange: refused alike, the group kept
        C.head_tensor = forged
    try:
        c.exchange(rank, None, "forged exchange")
        out.append("accepted")
    except DistributedError as e:
        out.append(f"{type(e).__name__}: {e}")
    finally:
        C.head_tensor = real
    ok = c._allgather_bytes(bytes([rank])) == [bytes([r]) for r in range(world)] and \
        c._broadcast_bytes(b"zero" if rank == 0 else b"") == b"zero" and \
        c.exchange(rank, None, "after") == list(range(world)) and c.broadcast_from_zero(rank) == 0
    out.append(f"still works: {ok}")
    return out


def forged_one_side(rank: int, world: int) -> list[str]:
    """A message length in ``gather_to_zero`` (whose sizes only rank 0 receives) forged past the limits, or
    negative: voted in the gather's first all-reduce, so every rank refuses it alike before anything is allocated,
    naming the rank, and the group works after."""
    import liferaft.dist.coordinator as C
    import liferaft.dist.wire as W
    from liferaft.dist import Coordinator
    from liferaft.errors import DistributedError

    c = Coordinator(timeout=20)
    real = C.length_tensor
    out = []
    for kind, liar, n in [("gather", 1, 1 << 40), ("gather", 2, -7), ("gather", 0, W.MAX_MESSAGE + 1)]:
        if rank == liar:
            C.length_tensor = lambda _m, _n=n: real(_n)
        try:
            if kind == "gather":
                c.gather_to_zero(f"rank {rank}", None, "forged gather")
            else:
                c.scatter_from_zero([f"for {r}" for r in range(world)] if rank == 0 else None, None, "forged scatter")
            out.append("accepted")
        except DistributedError as e:
            out.append(str(e))
        finally:
            C.length_tensor = real
    ok = c.gather_to_zero(rank, None, "after") == (list(range(world)) if rank == 0 else None) and \
        c.scatter_from_zero(list(range(world)) if rank == 0 else None, None, "after") == rank
    out.append(f"still works: {ok}")
    return out


def swapped_among(rank: int, world: int) -> list[object]:
    """``Coordinator.swap_among`` on 3 ranks: ranks 0 and 2 swap, rank 1 alone; short messages (one round) and
    long ones (past the head: a second round), a long and a short one crossing; then rank 2 forges a length past
    the limits: rank 0 refuses it before allocating anything for it, naming rank 2 (and retires its group)."""
    import liferaft.dist.coordinator as C
    import liferaft.dist.wire as W
    from liferaft.dist import Coordinator
    from liferaft.errors import DistributedError

    c = Coordinator(timeout=10)
    group = (0, 2) if rank != 1 else (1,)
    out: list[object] = []
    for n0, n2 in [(10, 20), (W.HEAD * 3, W.HEAD * 5), (W.HEAD * 2, 3), (0, W.HEAD - W.LEN)]:
        n = n0 if rank == 0 else n2 if rank == 2 else 7
        out.append(c.swap_among(group, b"x" * n + bytes([rank]), (0x5100, 0x5101), "swap"))
    real = C.head_tensor

    def forged(data: bytes, size: int) -> object:
        t = real(data, size)
        t[:W.LEN] = torch.frombuffer(bytearray((W.MAX_MESSAGE + 1).to_bytes(W.LEN, "little")), dtype=torch.uint8)
        return t
    if rank == 2:
        C.head_tensor = forged
    try:
        c.swap_among(group, b"y", (0x5102, 0x5103), "forged swap")
        out.append("accepted")
    except DistributedError as e:
        out.append(str(e))
    finally:
        C.head_tensor = real
    return out
