"""The framing of a collective's byte messages (``Coordinator``'s all-gathers and broadcasts): a first round of a
fixed size per rank carries each message's length (8 bytes, little-endian) and its first bytes, so that a short
message takes one round trip; a second round carries the rest of the long ones. Every rank decides from what the
first round brought, so every rank takes the same rounds. A long message moves ``8 + len`` bytes per rank in all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from liferaft.errors import DistributedError

HEAD = 4096             # bytes a rank sends in an all-gather's first round (its message's length, then its first bytes)
HEAD_TOTAL = 1 << 20    # ... fewer in a large world: all the first round's heads at most this many (``head_size``)
BROADCAST_HEAD = 256    # bytes of a broadcast's first round (rank 0's message's length, then its first bytes)
LEN = 8                 # bytes of a message's length, first in its head
#: the longest message a rank may announce, and the most bytes an all-gather's second round may make a rank
#: receive (its longest message times the ranks): metadata, never tensors; a length beyond them is refused on
#: every rank alike before anything is allocated (``check_lengths``)
MAX_MESSAGE = 1 << 33
MAX_RECEIVED = 1 << 34


def head_size(world: int) -> int:
    """An all-gather's first-round bytes per rank in a group of ``world`` ranks (the same on every rank):
    ``HEAD``, or less where ``world`` of them would pass ``HEAD_TOTAL``, down to the length alone (8 bytes: then
    every message takes the second round, as all did before). A message longer than its head sends its length
    and the rest once: ``8 + len`` bytes per rank in all, as before; a short one at most ``head_size`` bytes."""
    return max(LEN, min(HEAD, HEAD_TOTAL // max(1, world) // LEN * LEN))


class RefusedLength(DistributedError):
    """A collective's announced length was refused (``check_lengths``): every rank raised it alike, nothing is
    pending, and the group stays usable."""


def check_lengths(sizes: list[int], world: int, what: str) -> None:
    """Refuse the lengths the first round announced (``sizes``, per rank) before anything is allocated for them:
    one over ``MAX_MESSAGE``, or a second round that would make each of ``world`` ranks receive more than
    ``MAX_RECEIVED`` bytes. Every rank sees the same ``sizes``, so every rank raises alike (DistributedError
    naming the rank and the length: ``RefusedLength``) and none waits in a second round."""
    for rank, n in enumerate(sizes):
        if n > MAX_MESSAGE:
            raise RefusedLength(f"{what}: rank {rank} announced a message of {n} bytes (at most {MAX_MESSAGE}): "
                                   "not a liferaft peer of this version, or its memory is damaged; restart the job")
    if len(sizes) > 1 and max(sizes) * world > MAX_RECEIVED:
        rank = max(range(len(sizes)), key=sizes.__getitem__)
        raise RefusedLength(f"{what}: rank {rank}'s message of {sizes[rank]} bytes would make every one of {world} "
                               f"ranks receive {sizes[rank] * world} bytes (at most {MAX_RECEIVED}): send less "
                               "metadata per rank, or gather it to rank 0")


def check_one_side(sizes: dict[int, int], what: str, total: int = MAX_RECEIVED) -> None:
    """Refuse lengths that one rank alone was told (``sizes``: sender rank → announced bytes) before it allocates
    for them: a negative one, one over ``MAX_MESSAGE``, or more than ``total`` bytes in all (DistributedError
    naming the rank and the length). Only this rank sees them, so its peers are mid-protocol: the caller retires
    the group."""
    for rank, n in sorted(sizes.items()):
        if not 0 <= n <= MAX_MESSAGE:
            raise DistributedError(f"{what}: rank {rank} announced a message of {n} bytes (0 to {MAX_MESSAGE}): "
                                   "not a liferaft peer of this version, or its memory is damaged; restart the job")
    if sum(sizes.values()) > total:
        raise DistributedError(f"{what}: the ranks announced {sum(sizes.values())} bytes in all for this rank (at "
                               f"most {total}): send less metadata per rank")


def length_tensor(n: int) -> Any:
    """The one-number tensor announcing a message of ``n`` bytes (gathered or scattered before the message)."""
    import torch

    return torch.tensor([n], dtype=torch.int64)


def head_tensor(data: bytes | bytearray, size: int) -> Any:
    """The first round's tensor of ``data``: ``size`` bytes, its length (8 bytes, little-endian), then as much
    of it as fits."""
    import torch

    head = torch.zeros(size, dtype=torch.uint8)
    view = head.numpy()
    view[:LEN] = np.frombuffer(len(data).to_bytes(LEN, "little"), dtype=np.uint8)
    n = min(len(data), size - LEN)
    if n:
        view[LEN:LEN + n] = np.frombuffer(data, dtype=np.uint8, count=n)
    return head


def tail_tensor(data: bytes | bytearray, room: int, length: int) -> Any:
    """The second round's tensor of ``data``: ``length`` bytes, what follows its first ``room`` bytes (then
    zeros); copied once from ``data``, no slice of it made."""
    import torch

    tail = torch.zeros(length, dtype=torch.uint8)
    if len(data) > room:
        tail.numpy()[:len(data) - room] = np.frombuffer(data, dtype=np.uint8, offset=room)
    return tail


def receive_buffer(head: bytes, room: int, length: int) -> tuple[bytearray, Any]:
    """A message of ``length`` bytes whose first round brought ``head`` (length first): a buffer holding its first
    ``room`` bytes, and the tensor over the rest of that buffer into which the second round receives (no copy
    after it)."""
    import torch

    out = bytearray(length)
    out[:room] = head[LEN:LEN + room]
    return out, torch.frombuffer(out, dtype=torch.uint8, offset=room)
