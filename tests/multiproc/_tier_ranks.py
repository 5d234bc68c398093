"""Rank functions for the memory-tier tests (imported as ``multiproc._tier_ranks``): ranks grouped into simulated
nodes (each its own shared-memory namespace), saving every step into the memory tier and every few steps to disk."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from multiproc._crash_ranks import _equal, state_at

import liferaft
from liferaft import JobOptions, TierOptions
from liferaft.tiers.memory import MemoryTier


def node_of(rank: int, per_node: int) -> str:
    return f"n{rank // per_node}"


def job(rank: int, world: int, base: str, disk: str, per_node: int, last: int, disk_every: int,
        kill_at: int = -1, kill_ranks: tuple[int, ...] = (1,)) -> tuple[str, int | None, bool]:
    """Restore (memory tier first, then the newest disk checkpoint), then save steps up to ``last``: memory every
    step, disk every ``disk_every``; the ranks in ``kill_ranks`` kill -9 themselves right after the memory save of
    step ``kill_at`` is complete.
    Returns (where the restore came from, restored step, exact)."""
    tier = MemoryTier("tier-test", node=node_of(rank, per_node), base=base, replicas=1, keep=2)
    st = state_at(rank, world, -1)
    source, start = "none", tier.restore(st)
    if start is not None:
        source = "memory"
    else:
        steps = sorted(int(d[5:]) for d in os.listdir(disk) if d.startswith("step-")
                       and os.path.exists(os.path.join(disk, d, "COMMIT"))) if os.path.isdir(disk) else []
        if steps:
            liferaft.load(os.path.join(disk, f"step-{steps[-1]:010d}"), st)
            source, start = "disk", steps[-1]
    exact = start is None or _equal(st, state_at(rank, world, start))
    for step in range(0 if start is None else start + 1, last + 1):
        now = state_at(rank, world, step)
        tier.save(step, now)
        if step == kill_at and rank in kill_ranks:
            tier.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if step % disk_every == 0:
            liferaft.save(os.path.join(disk, f"step-{step:010d}"), now)
    tier.wait()
    return source, start, exact


def held(base: str) -> dict[str, list[str]]:
    """node → the files under its namespace (for assertions)."""
    root = os.path.join(base, "tier-test")
    out: dict[str, list[str]] = {}
    for node in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        out[node] = sorted(os.path.relpath(os.path.join(d, f), os.path.join(root, node))
                           for d, _, fs in os.walk(os.path.join(root, node)) for f in fs)
    return out


def release(rank: int, world: int, base: str, per_node: int) -> None:
    MemoryTier("tier-test", node=node_of(rank, per_node), base=base).release()


def unused(*_: Any) -> None:
    torch.zeros(1)


def managed(rank: int, world: int, base: str, root: str, per_node: int, last: int,
            drain: bool = True, remote: str | None = None, back_to: int | None = None) -> tuple[int | None, bool, dict]:
    """CheckpointManager with a memory tier: every step to memory, every 4 steps drained to the root (or saved to
    it directly); restore (``back_to``: exactly that step, a rollback), go on. Each step waits for the memory tier
    (a step of a real loop takes longer than this tiny save), so that no memory save is skipped as busy."""
    from liferaft import CheckpointManager

    tier = MemoryTier("tier-test", node=node_of(rank, per_node), base=base)
    st = state_at(rank, world, -1)
    with CheckpointManager(root, every_steps=4, tiers=TierOptions(tier, drain=drain, remote=remote, remote_every=2),
                           job=JobOptions(job_id="tier-job", lease_ttl=5.0)) as mgr:
        start = mgr.restore(st, step=back_to)
        exact = start is None or _equal(st, state_at(rank, world, start))
        info = dict(tier.last_restore or {})
        for step in range(0 if start is None else start + 1, last + 1):
            mgr.maybe_save(step, state_at(rank, world, step))
            tier.wait()
        mgr.wait()
        info["listing"] = [(i.step, i.tiers) for i in mgr.steps()]
    return start, exact, info


def transfer_in_pieces(rank: int, world: int, root: str) -> bool:
    """transfer_files with 4 KiB pieces: rank 0 sends a 50 000-byte file and receives a 9 000-byte one."""
    import os

    from liferaft.dist import Coordinator
    from liferaft.storage.posix import PosixStorage
    from liferaft.tiers.memory import transfer_files

    mine = PosixStorage(os.path.join(root, f"r{rank}"))
    data = {0: bytes((i * 7) % 251 for i in range(50_000)), 1: bytes((i * 13) % 253 for i in range(9_000))}
    w = mine.open_writer(f"f{rank}")
    w.pwrite(data[rank], 0)
    w.close()
    other = 1 - rank
    transfer_files(Coordinator(), mine, [(other, f"f{rank}", len(data[rank]))], [(other, f"f{other}",
                   len(data[other]))], rank, piece=4096)
    return mine.read_all(f"f{other}") == data[other]



def transfer_ring(rank: int, world: int, root: str) -> list[bool]:
    """transfer_files around a ring of ``world`` ranks, twice through the same ``Buffers``: each rank sends two
    files (of several pieces, and one smaller than a piece) to the next rank while it receives the previous
    rank's two (both directions at once); returns, per call, whether the received bytes are the sender's."""
    import os

    from liferaft.dist import Coordinator
    from liferaft.storage.posix import PosixStorage
    from liferaft.tiers.memory import Buffers, transfer_files

    def data(r: int, k: int, call: int) -> bytes:
        n = (70_000 if k == 0 else 3_000) + 1_000 * r + call
        return bytes((i * (r + 3) + k + call) % 251 for i in range(n))

    buffers, out = Buffers(), []
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    for call in range(2):
        mine = PosixStorage(os.path.join(root, f"c{call}", f"r{rank}"))
        for k in range(2):
            w = mine.open_writer(f"f{rank}-{k}")
            w.pwrite(data(rank, k, call), 0)
            w.close()
        transfer_files(Coordinator(), mine, [(nxt, f"f{rank}-{k}", len(data(rank, k, call))) for k in (1, 0)],
                       [(prev, f"f{prev}-{k}", len(data(prev, k, call))) for k in (0, 1)], rank, piece=16_384,
                       buffers=buffers)
        out.append(all(mine.read_all(f"f{prev}-{k}") == data(prev, k, call) for k in range(2)))
    return out


def transfer_with_a_local_failure(rank: int, world: int, root: str, mode: str) -> tuple[str, float, list[str]]:
    """transfer_files on 3 ranks, each sending a file of 3 pieces to both others, where rank 1 fails locally:
    ``mode`` "full" (its writes of received pieces raise ENOSPC, as a full /dev/shm does) or "short" (its own
    file is shorter than the size announced for it). Returns (the error's class and message, or "ok"; seconds;
    receiving threads still alive after the call)."""
    import errno
    import os
    import threading
    import time

    from liferaft.dist import Coordinator
    from liferaft.storage.posix import PosixStorage, _PosixWriter
    from liferaft.tiers.memory import transfer_files

    class Full(_PosixWriter):
        def pwrite(self, data, offset: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    class FullStorage(PosixStorage):
        def open_writer(self, name: str):
            path = self._p(name)
            self._mkdirs(path)
            return Full(path)

    size, piece = 3 * 16_384 + 5, 16_384
    kind = FullStorage if mode == "full" and rank == 1 else PosixStorage
    mine = kind(os.path.join(root, f"r{rank}"))
    w = PosixStorage(mine.root).open_writer(f"f{rank}")
    w.pwrite(bytes(size // 2 if mode == "short" and rank == 1 else size), 0)
    w.close()
    others = [r for r in range(world) if r != rank]
    t0 = time.monotonic()
    try:
        transfer_files(Coordinator(timeout=4.0), mine, [(o, f"f{rank}", size) for o in others],
                       [(o, f"f{o}", size) for o in others], rank, piece=piece)
        said = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        said = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    time.sleep(0.1)
    return said, took, [t.name for t in threading.enumerate() if t.name == "liferaft-tier-recv"]


def restore_damaged(rank: int, world: int, base: str, per_node: int, out: str, kill_rank: int | None = None) -> None:
    """Save step 1 on every node, lose node 1 (its memory), then restore step 1: the ranks of node 1 get every
    byte from node 0's replicas. Before the restore, the damage: with ``kill_rank``, that rank kill -9s itself
    while the restore runs (a thread, 0.05 s after it starts); without, node 0's replica of rank 2's file has one
    byte flipped. Each surviving rank writes ``out/<rank>.json``: [error class or "restored", message, whether
    every element of its state is the old value or step 1's (nothing damaged landed)]."""
    import json
    import shutil
    import threading
    import time

    from liferaft.errors import LiferaftError

    tier = MemoryTier("tier-damage", node=node_of(rank, per_node), base=base, replicas=1, timeout=20.0)
    saved = state_at(rank, world, 1)
    tier.save(1, saved, wait=True)
    torch.distributed.barrier()
    if node_of(rank, per_node) == "n1":
        shutil.rmtree(tier.root, ignore_errors=True)
    if rank == 0 and kill_rank is None:
        step = tier.step_storage(1).root
        victim = next(os.path.join(d, f) for d, _, fs in os.walk(step) for f in fs if f == "r00002.bin")
        with open(victim, "r+b") as f:
            f.seek(4096 + 17)
            b = f.read(1)
            f.seek(4096 + 17)
            f.write(bytes([b[0] ^ 0x40]))
    torch.distributed.barrier()
    if rank == kill_rank:
        threading.Thread(target=lambda: (time.sleep(0.05), os.kill(os.getpid(), signal.SIGKILL)),
                         daemon=True).start()
    st, before = state_at(rank, world, -1), state_at(rank, world, -1)
    try:
        result = ["restored", str(tier.restore(st))]
    except LiferaftError as e:
        result = [type(e).__name__, str(e)]
    clean = all(bool(((st[k].local == before[k].local) | (st[k].local == saved[k].local)).all())
                for k in ("w", "m", "frozen"))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result + [clean], f)
