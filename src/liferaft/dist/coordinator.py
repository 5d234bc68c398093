"""Collectives for metadata: work with no process group, raise every rank's error on every rank, time out.

Every collective takes its timeout from the caller (the options' ``timeout``), whatever timeout the group was
made with, and fails as :class:`DistributedError` naming the phase. A group whose collective failed is retired:
the next caller gets a fresh one (every rank that saw the failure does the same, so the generations stay in
step). Each call exchanges ``(error or None, payload)``: if any rank failed, every rank raises — the failing rank
its own exception, the others a DistributedError naming the failed ranks and their errors.
:meth:`Coordinator.run` / :meth:`Coordinator.run_on_zero` are how a phase is written: "run this step (here, or on
rank 0); if any rank failed, raise on all".

The groups themselves (made once per process group and channel, retired after a failure, released at exit):
``dist.groups``.
"""

from __future__ import annotations

import datetime
import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from liferaft.dist.groups import Group, attempt, group_for, one_line, release_groups
from liferaft.dist.wire import (
    BROADCAST_HEAD,
    HEAD,
    LEN,
    MAX_MESSAGE,
    RefusedLength,
    check_lengths,
    check_one_side,
    head_size,
    head_tensor,
    length_tensor,
    receive_buffer,
    tail_tensor,
)
from liferaft.errors import DistributedError, InvalidStateError

T = TypeVar("T")

#: the tag of ``Coordinator.gather_to_zero``'s sends (a channel runs one collective at a time; the tags of a
#: load's shared spans count up from 0)
GATHER_TAG = 0x4C46_0001
#: the tag of ``Coordinator.scatter_from_zero``'s sends (``core.stages``'s are 0x4C46_0006/7)
SCATTER_TAG = 0x4C46_0008


class _Work:
    """A send or receive under way; ``wait()`` is bounded by the coordinator's timeout."""

    def __init__(self, work: Any, group: Group, timeout: float, what: str) -> None:
        self._work, self._group, self._timeout, self._what = work, group, timeout, what

    def wait(self) -> None:
        try:
            self._work.wait(datetime.timedelta(seconds=self._timeout))
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            self._group.fail()
            raise DistributedError(f"{self._what} failed (a peer died or did not answer within "
                                   f"{self._timeout:.0f}s): {one_line(e)}") from None


class MaxVote:
    """An element-wise maximum over the ranks under way (``Coordinator.all_max_start``)."""

    def __init__(self, coord: Coordinator, tensor: Any, work: Any, what: str) -> None:
        self._coord, self._t, self._work, self._what = coord, tensor, work, what

    def result(self) -> list[int]:
        """The maximum (waits for it, bounded by the coordinator's timeout; a lost peer is a DistributedError)."""
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait(datetime.timedelta(seconds=self._coord.timeout))
            except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
                raise self._coord._fail(e, self._what, None) from None
        return [int(x) for x in self._t.tolist()]


class Coordinator:
    """The ranks of one save or load. ``rank``/``world`` are within ``process_group`` (default: the world).

    ``channel`` names an independent gloo group: the background thread of an async save uses "bg", so that its
    exchanges never interleave with those of the caller's thread ("fg"). Groups are made (collectively) the first
    time a channel is used, always from the caller's thread; every collective is bounded by ``timeout`` seconds.
    ``key`` names the group this coordinator talks over (a new group, after a release or a failure, has a new key).
    """

    def __init__(self, process_group: Any = None, timeout: float = 600.0, channel: str = "fg") -> None:
        import torch.distributed as dist

        self.timeout = timeout
        self.group: Group | None = None
        self.key = "local"
        #: whether this coordinator's rank ``i`` is the job's global rank ``i`` for every ``i`` (a DeviceMesh
        #: names global ranks)
        self.global_order = True
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise DistributedError("a process_group was given but torch.distributed is not initialized")
            self.rank, self.world = 0, 1
            return
        pg = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)
        self.global_order = pg is dist.group.WORLD or dist.get_process_group_ranks(pg) == list(range(self.world))
        if self.world > 1:
            self.group = group_for(pg, timeout, channel)
            self.key = self.group.name

    def _fail(self, e: BaseException, what: str, error: BaseException | None) -> BaseException:
        assert self.group is not None
        self.group.fail()
        if error is not None:
            return error
        return DistributedError(f"{what or 'collective'} failed on rank {self.rank} of {self.world} (a peer died or "
                                f"did not arrive within {self.timeout:.0f}s): {one_line(e)}")

    def _allgather_bytes(self, data: bytes) -> list[bytes | memoryview]:
        """Every rank's ``data``, in rank order: one all-gather of ``head_size(world)`` bytes per rank (the length,
        then the first bytes), and a second one of the rest only when some rank's ``data`` does not fit (most of
        a collective phase's messages do: one round trip instead of two)."""
        import torch
        import torch._C._distributed_c10d as c10d

        assert self.group is not None
        opts = c10d.AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        size = head_size(self.world)
        room = size - LEN
        heads = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world)]
        self.group.backend.allgather([heads], [head_tensor(data, size)], opts).wait()
        raw = [h.numpy().tobytes() for h in heads]
        sizes = [int.from_bytes(r[:LEN], "little") for r in raw]
        longest = max(sizes)
        if longest <= room:
            return [r[LEN:LEN + n] for r, n in zip(raw, sizes)]
        check_lengths(sizes, self.world, "an all-gather of liferaft's metadata")
        # (every rank receives ``longest`` bytes per rank: a buffer each, its tail received in place)
        bufs, tails = zip(*(receive_buffer(r, room, longest) for r in raw))
        self.group.backend.allgather([list(tails)], [tail_tensor(data, room, longest - room)], opts).wait()
        return [data if i == self.rank else memoryview(b)[:n] for i, (b, n) in enumerate(zip(bufs, sizes))]

    def _broadcast_bytes(self, data: bytes) -> bytes | bytearray:
        """Rank 0's ``data`` on every rank: one broadcast of ``BROADCAST_HEAD`` bytes (the length, then the first
        bytes), and a second one of the rest only when it does not fit."""
        import torch._C._distributed_c10d as c10d

        assert self.group is not None
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        room = BROADCAST_HEAD - LEN
        head = head_tensor(data if self.rank == 0 else b"", BROADCAST_HEAD)
        self.group.backend.broadcast([head], opts).wait()
        raw = head.numpy().tobytes()
        size = int.from_bytes(raw[:LEN], "little")
        if size <= room:
            return raw[LEN:LEN + size]
        check_lengths([size], self.world, "a broadcast of liferaft's metadata")
        if self.rank == 0:
            self.group.backend.broadcast([tail_tensor(data, room, size - room)], opts).wait()
            return data
        out, tail = receive_buffer(raw, room, size)
        self.group.backend.broadcast([tail], opts).wait()
        return out

    def exchange(self, payload: Any, error: BaseException | None = None, what: str = "") -> list[Any]:
        """All-gather ``payload`` from every rank; raise on every rank if any rank passed an ``error``."""
        if self.world == 1 or self.group is None:
            if error is not None:
                raise error
            return [payload]
        msg = None
        if error is not None:
            msg = f"{type(error).__name__}: {error}"
            if not isinstance(error, Exception) or type(error).__module__.split(".")[0] != "liferaft":
                msg += "\n" + "".join(traceback.format_exception(error)[-3:])
        data = pickle.dumps((msg, None if error is not None else payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            gathered = [pickle.loads(b) for b in self._allgather_bytes(data)]  # our own ranks' messages
        except RefusedLength as e:      # (every rank refused alike, nothing pending: the group stays)
            raise error if error is not None else DistributedError(f"{what or 'collective'}: {e}") from None
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            raise self._fail(e, what, error) from None
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
        msg = None if error is None else f"{type(error).__name__}: {error}"
        data = pickle.dumps((msg, payload if error is None else None), protocol=pickle.HIGHEST_PROTOCOL) \
            if self.rank == 0 else b""
        try:
            m, p = pickle.loads(self._broadcast_bytes(data))
        except RefusedLength as e:      # (every rank refused alike, nothing pending: the group stays)
            raise error if error is not None else DistributedError(f"{what or 'broadcast'}: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise self._fail(e, what or "broadcast", error) from None
        if m is not None:
            if error is not None:
                raise error
            raise DistributedError(f"{what or 'operation'} failed on rank 0:\n  rank 0: {m}")
        return p

    def run(self, step: Callable[[], T], what: str, *, cleanup: Callable[[], object] | None = None) -> list[T]:
        """Run ``step`` on this rank, then exchange the outcome: every rank's result (in rank order) when every
        rank succeeded; otherwise every rank raises (the failing rank its own exception, the others a
        DistributedError naming the failed ranks and their errors, ``what`` naming the phase). ``cleanup``, if
        given, runs on this rank before it raises (whatever failed: its step, a peer's, or the exchange), e.g.
        to remove files of a save that will not commit (it should not raise: what it raises replaces the
        error). The one way a collective phase that can fail on one rank is written; a step that must keep more
        than it shares sets it aside itself (a ``nonlocal``)."""
        result, error = attempt(step)
        try:
            return self.exchange(result, error, what)
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise

    def gather_to_zero(self, payload: Any, error: BaseException | None = None, what: str = "") -> list[Any] | None:
        """Every rank's ``payload`` on rank 0 (in rank order; None on the other ranks), with the error semantics
        of :meth:`exchange`: if any rank passed an ``error`` (or its payload cannot be pickled), every rank
        raises. Each message travels at its own size (its length gathered first, then one send to rank 0), so
        rank 0 holds the sum of the messages; what a rank other than 0 receives does not grow with the world
        (one all-reduce of two numbers; the messages of failed ranks only when some failed). A length outside 0 to
        ``wire.MAX_MESSAGE`` is voted in that all-reduce and refused by every rank alike before anything is
        allocated (``RefusedLength``, naming the rank; the group stays usable); rank 0 also refuses sizes unlike
        their vote or more than ``wire.MAX_RECEIVED`` in all, alone (its group retired: a peer's send still
        pending fails at once, one already done meets the retired group at its next collective, within the
        timeout). For what only rank 0 needs from everyone (what goes in the manifest)."""
        if error is None:
            try:
                data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - reported to every rank like a failed step
                error = e
        if self.world == 1 or self.group is None:
            if error is not None:
                raise error
            return [payload]
        import torch
        import torch._C._distributed_c10d as c10d

        n = int(length_tensor(len(data)).item()) if error is None else 0
        bad = error is None and not 0 <= n <= MAX_MESSAGE       # (voted: refused by every rank alike, below)
        vote = self.all_max([int(error is not None), self.rank + 1 if bad else 0], what)
        if vote[0]:
            self.exchange(None, error, what)        # raises on every rank, naming the failed ranks
            raise DistributedError(f"{what or 'operation'} failed on a rank that sent no message")
        if vote[1]:                     # (nothing pending: the group stays usable)
            liar = vote[1] - 1
            raise RefusedLength(f"{what or 'gather to rank 0'}: rank {liar} announced a message of "
                                f"{n if liar == self.rank else 'a length outside 0 to ' + str(MAX_MESSAGE)} bytes"
                                f"{f' (0 to {MAX_MESSAGE})' if liar == self.rank else ''}: not a liferaft peer of "
                                "this version, or its memory is damaged; restart the job")
        size = torch.tensor([n], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)] if self.rank == 0 else []
        opts = c10d.GatherOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        try:
            self.group.backend.gather([sizes] if self.rank == 0 else [], [size], opts).wait()
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            raise self._fail(e, what, None) from None
        if self.rank != 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)     # (alive until the send is done)
            self.isend(buf, 0, GATHER_TAG).wait()
            return None
        announced = {r: int(t.item()) for r, t in enumerate(sizes) if r}
        try:    # (a size unlike its rank's vote, or too many bytes in all: rank 0 alone sees it, so the group goes)
            check_one_side(announced, what or "gather to rank 0")
        except DistributedError as e:
            raise self._fail(e, what, e) from None
        bufs = {r: torch.empty(n, dtype=torch.uint8) for r, n in announced.items()}
        for w in [self.irecv(buf, r, GATHER_TAG) for r, buf in bufs.items()]:
            w.wait()
        return [payload] + [pickle.loads(bufs[r].numpy().tobytes()) for r in range(1, self.world)]  # our ranks'

    def scatter_from_zero(self, payloads: Sequence[Any] | None, error: BaseException | None = None,
                          what: str = "") -> Any:
        """``payloads[r]`` (given on rank 0, one per rank) on each rank ``r``: one scatter of the messages' sizes,
        then one send from rank 0 to each other rank, so that what a rank receives is its own message only. If
        rank 0 passed an ``error`` (or a payload cannot be pickled), every rank raises (rank 0 its error, the
        others a DistributedError naming it; an ``error`` on another rank is not seen: such a rank must not call
        this). For what rank 0 knows and each rank needs its own part of (a rank's chunk table of an incremental
        save's base)."""
        data: list[bytes] = []
        if self.rank == 0 and error is None:
            try:
                if payloads is None or len(payloads) != self.world:
                    raise InvalidStateError(f"{what}: {0 if payloads is None else len(payloads)} payloads for "
                                            f"{self.world} ranks")
                data = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in payloads]
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = e
        if self.world == 1 or self.group is None:
            if error is not None:
                raise error
            return payloads[0] if payloads is not None else None
        import torch
        import torch._C._distributed_c10d as c10d

        opts = c10d.ScatterOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        size = torch.zeros(1, dtype=torch.int64)
        sizes = [torch.tensor([-1 if error is not None else len(d)], dtype=torch.int64)
                 for d in (data or [b""] * self.world)] if self.rank == 0 else []
        try:
            self.group.backend.scatter([size], [sizes] if self.rank == 0 else [], opts).wait()
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            raise self._fail(e, what, error) from None
        if int(size.item()) < 0:        # rank 0 failed: its error to every rank
            self.broadcast_from_zero(None, error, what)
            raise DistributedError(f"{what or 'operation'} failed on rank 0")
        if self.rank == 0:
            bufs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data[1:]]  # (alive until sent)
            for w in [self.isend(b, r, SCATTER_TAG) for r, b in enumerate(bufs, 1) if b.numel()]:
                w.wait()
            return payloads[0]      # type: ignore[index]  (checked above)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            self.irecv(buf, 0, SCATTER_TAG).wait()
        return pickle.loads(buf.numpy().tobytes())     # rank 0's message (one of our own ranks)

    def peers_alike(self, value: int, what: str) -> tuple[int, ...]:
        """The ranks (this one included, in order) that passed the same ``value`` (a host's id, say; a signed
        64-bit number, as ``gather_int_to_zero`` sends it): each
        rank's value gathered to rank 0 (8 bytes each), which groups them and sends each rank its own group
        (``scatter_from_zero``), so that what a rank receives grows with its group, not with the world."""
        values = self.gather_int_to_zero(value, what)
        groups: list[tuple[int, ...]] | None = None
        if values is not None:
            members: dict[int, list[int]] = {}
            for r, v in enumerate(values):
                members.setdefault(v, []).append(r)
            frozen = {v: tuple(rs) for v, rs in members.items()}
            groups = [frozen[v] for v in values]
        return tuple(self.scatter_from_zero(groups, None, what))

    def gather_some(self, ranks: tuple[int, ...], payload: Any, tags: tuple[int, int], what: str,
                    limit: int = 1 << 30) -> dict[int, Any] | None:
        """On rank 0, ``{r: payload of rank r}`` for rank 0 and each of ``ranks`` (the others' sent point to point:
        a message's size with tag ``tags[0]``, then the message with ``tags[1]``); None on the other ranks, which
        send only if they are among ``ranks``. What rank 0 receives grows with ``ranks``, not with the world. A
        message over ``limit`` bytes, a lost peer or a timeout raises (DistributedError; a caller reports it to
        every rank with the broadcast that follows, so that none waits)."""
        import torch

        if self.rank == 0:
            sizes = {r: torch.zeros(1, dtype=torch.int64) for r in ranks if r}
            for w in [self.irecv(t, r, tags[0]) for r, t in sizes.items()]:
                w.wait()
            if any(not 0 < int(t.item()) <= limit for t in sizes.values()):
                raise DistributedError(f"{what}: a rank announced a message of "
                                       f"{max(int(t.item()) for t in sizes.values())} bytes (at most {limit})")
            bufs = {r: torch.empty(int(t.item()), dtype=torch.uint8) for r, t in sizes.items()}
            for w in [self.irecv(b, r, tags[1]) for r, b in bufs.items()]:
                w.wait()
            return {0: payload, **{r: pickle.loads(b.numpy().tobytes()) for r, b in bufs.items()}}  # our ranks'
        if self.rank in ranks:
            data = torch.frombuffer(bytearray(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            self.isend(torch.tensor([data.numel()], dtype=torch.int64), 0, tags[0]).wait()
            self.isend(data, 0, tags[1]).wait()
        return None

    def swap_among(self, ranks: Sequence[int], payload: Any, tags: tuple[int, int], what: str) -> dict[int, Any]:
        """``{r: payload of rank r}`` for each of ``ranks`` (this rank among them), sent point to point among those
        ranks only: a head of ``HEAD`` bytes to each (the pickled message's length and first bytes, tag
        ``tags[0]``: a short message takes one round), then the rest of a long one (tag ``tags[1]``). The lengths
        a rank is told are checked before anything is allocated for them (refused: DistributedError, and the
        group goes, its peers mid-exchange). Collective over ``ranks``."""
        import torch

        mates = [r for r in ranks if r != self.rank]
        out = {self.rank: payload}
        if not mates:
            return out
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        room = HEAD - LEN
        heads = {r: torch.empty(HEAD, dtype=torch.uint8) for r in mates}
        head = head_tensor(data, HEAD)
        for w in [self.irecv(heads[r], r, tags[0]) for r in mates] + [self.isend(head, r, tags[0]) for r in mates]:
            w.wait()
        raw = {r: heads[r].numpy().tobytes() for r in mates}
        sizes = {r: int.from_bytes(raw[r][:LEN], "little") for r in mates}
        try:
            check_one_side(sizes, what)
        except DistributedError as e:
            raise self._fail(e, what, e) from None
        long = {r: receive_buffer(raw[r], room, sizes[r]) for r in mates if sizes[r] > room}
        works = [self.irecv(tail, r, tags[1]) for r, (_, tail) in long.items()]
        if len(data) > room:
            tail = tail_tensor(data, room, len(data) - room)
            works += [self.isend(tail, r, tags[1]) for r in mates]
        for w in works:
            w.wait()
        for r in mates:
            out[r] = pickle.loads(long[r][0] if r in long else raw[r][LEN:LEN + sizes[r]])     # (our own ranks')
        return out

    def gather_int_to_zero(self, value: int, what: str) -> list[int] | None:
        """Every rank's 64-bit ``value`` on rank 0, in rank order (None on the other ranks): one gather, each rank
        sending 8 bytes."""
        import torch
        import torch._C._distributed_c10d as c10d

        if self.world == 1 or self.group is None:
            return [value]
        opts = c10d.GatherOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)] if self.rank == 0 else []
        try:
            self.group.backend.gather([out] if self.rank == 0 else [], [torch.tensor([value], dtype=torch.int64)],
                                      opts).wait()
        except Exception as e:  # noqa: BLE001 - gloo reports timeouts and lost peers as RuntimeError
            raise self._fail(e, what, None) from None
        return [int(t.item()) for t in out] if self.rank == 0 else None

    def run_max(self, step: Callable[[], tuple[T, list[int]]], width: int, what: str, *,
                cleanup: Callable[[], object] | None = None) -> tuple[T, list[int]]:
        """Run ``step`` on this rank (it returns a result kept here and ``width`` numbers to vote on), then one
        all-reduce: the element-wise maximum of every rank's numbers. If any rank's step failed, every rank
        raises as in :meth:`run` (``cleanup`` first). What a rank receives does not grow with the world."""
        result, error = attempt(step)
        numbers = list(result[1]) if result is not None else [0] * width
        if len(numbers) != width:           # (reported like a failed step, so that no rank waits for this one)
            result, error, numbers = None, ValueError(f"run_max: the step gave {len(numbers)} numbers, not "
                                                      f"{width}"), [0] * width
        try:
            vote = self.all_max([int(error is not None)] + numbers, what)
            if vote[0]:
                self.exchange(None, error, what)
                raise DistributedError(f"{what or 'operation'} failed on a rank that sent no message")
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise
        assert result is not None
        return result[0], vote[1:]

    def run_on_zero(self, step: Callable[[], T], what: str) -> T:
        """Run ``step`` on rank 0 only and give its result to every rank; if it fails, every rank raises (rank 0
        its own exception, the others a DistributedError naming rank 0's). For what one rank reads for all (a
        manifest, a listing): one broadcast, so a large result is not gathered ``world`` times."""
        result, error = attempt(step) if self.rank == 0 else (None, None)
        return self.broadcast_from_zero(result, error, what)

    def all_max(self, values: list[int], what: str) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks (one all-reduce of a small tensor, no pickling:
        for a vote made at every step). Bounded by the timeout; a lost peer is a DistributedError naming ``what``."""
        return self.all_max_start(values, what).result()

    def all_sum(self, values: list[int], what: str) -> list[int]:
        """The element-wise sum of ``values`` over the ranks (one all-reduce of int64; the caller keeps the sums
        within 63 bits). Bounded by the timeout; a lost peer is a DistributedError naming ``what``."""
        import torch
        import torch._C._distributed_c10d as c10d

        t = torch.tensor(values, dtype=torch.int64)
        if self.world == 1 or self.group is None:
            return t.tolist()
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c10d.ReduceOp.SUM
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        try:
            self.group.backend.allreduce([t], opts).wait()
        except Exception as e:  # noqa: BLE001 - gloo reports a closed peer as RuntimeError
            raise self._fail(e, what, None) from None
        return t.tolist()

    def all_max_start(self, values: list[int], what: str) -> MaxVote:
        """``all_max`` started now, its result taken later by ``result()``: the all-reduce runs meanwhile (a vote
        cast at one step and read at the next costs a step no round trip). Collective, in the same order on every
        rank as any other collective of this coordinator."""
        import torch
        import torch._C._distributed_c10d as c10d

        t = torch.tensor(values, dtype=torch.int64)
        if self.world == 1 or self.group is None:
            return MaxVote(self, t, None, what)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c10d.ReduceOp.MAX
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        try:
            work = self.group.backend.allreduce([t], opts)
        except Exception as e:  # noqa: BLE001 - gloo reports a closed peer as RuntimeError
            raise self._fail(e, what, None) from None
        return MaxVote(self, t, work, what)

    def isend(self, tensor: Any, rank: int, tag: int) -> _Work:
        """Start sending ``tensor`` to ``rank`` (of this coordinator); ``wait()`` on the result is bounded. A
        failure to post it (a peer's connection already closed) raises DistributedError and marks the group
        broken, as a failed wait does."""
        what = f"sending {tensor.numel()} bytes to rank {rank}"
        return _Work(self._post(lambda g: g.backend.send([tensor], rank, tag), what), self._live(), self.timeout,
                     what)

    def irecv(self, tensor: Any, rank: int, tag: int) -> _Work:
        """Start receiving into ``tensor`` from ``rank``; ``wait()`` on the result is bounded by the timeout (a
        failure to post it: as for ``isend``)."""
        what = f"receiving {tensor.numel()} bytes from rank {rank}"
        return _Work(self._post(lambda g: g.backend.recv([tensor], rank, tag), what), self._live(), self.timeout,
                     what)

    def _live(self) -> Group:
        assert self.group is not None
        return self.group

    def _post(self, start: Any, what: str) -> Any:
        group = self._live()
        try:
            return start(group)
        except Exception as e:  # noqa: BLE001 - gloo reports a closed peer connection as RuntimeError
            group.fail()
            raise DistributedError(f"{what} failed (a peer died or closed its connection): {one_line(e)}") from None


__all__ = ["Coordinator", "MaxVote", "release_groups"]
