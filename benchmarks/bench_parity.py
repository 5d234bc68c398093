"""Memory-tier redundancy: a full replica per node against XOR parity across a group of nodes (REFT).

4 ranks, each its own simulated node (its own shared-memory namespace under /dev/shm), gloo over 127.0.0.1; fp32
state of ``--size-mib`` per rank. For each method (``MemoryTier(replicas=1)``, ``MemoryTier(parity=4)``,
``MemoryTier(parity=2)``): a save until it is committed on every node and its redundancy is in place (seconds), the
memory each node holds (its own data, plus the replica or the parity), then node 1's namespace deleted (the node
lost) and a restore on the 4 ranks timed (the replica read from the peer, or node 1's files rebuilt from the
group's parity), checked bit-exact. Median of ``--reps``.

    python benchmarks/bench_parity.py [--size-mib 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time
import uuid
from typing import Any

from _common import machine  # sets up the paths

METHODS = {"replica (replicas=1)": {"replicas": 1}, "parity, groups of 4 (parity=4)": {"parity": 4},
           "parity, groups of 2 (parity=2)": {"parity": 2}}


def worker(rank: int, world: int, base: str, nbytes: int, kw: dict[str, Any]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import liferaft
    from liferaft.tiers.memory import MemoryTier

    rows = nbytes // 4 // 1024
    g = torch.Generator().manual_seed(rank)
    state = {"w": liferaft.Sharded(torch.randn(rows, 1024, generator=g), (rows * world, 1024), (rows * rank, 0))}
    tier = MemoryTier("bench-parity", node=f"n{rank}", base=base, **kw)
    tier.save(0, state, wait=True)                   # (warm-up: buffers, groups)
    dist.barrier()
    t0 = time.perf_counter()
    tier.save(1, state, wait=True)
    dist.barrier()
    save_s = time.perf_counter() - t0
    held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tier.root) for f in fs
               if "step-0000000001" in d)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(tier.root)
    dist.barrier()
    target = {"w": liferaft.Sharded(torch.zeros(rows, 1024), (rows * world, 1024), (rows * rank, 0))}
    tier2 = MemoryTier("bench-parity", node=f"n{rank}", base=base, **kw)
    t0 = time.perf_counter()
    step = tier2.restore(target)
    restore_s = time.perf_counter() - t0
    ok = step == 1 and torch.equal(target["w"].local, state["w"].local)
    shutil.rmtree(tier2.root, ignore_errors=True)
    return {"save": save_s, "held": held, "restore": restore_s, "ok": float(ok), "own": float(nbytes)}


def main(argv: list[str] | None = None) -> int:
    from liferaft.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    res: dict[str, list[list[dict[str, float]]]] = {m: [] for m in METHODS}
    for _ in range(args.reps):
        for method, kw in METHODS.items():
            base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"bench-parity-{uuid.uuid4().hex[:8]}")
            try:
                out = run_ranks(worker, 4, base, args.size_mib << 20, kw, timeout=900)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if not all(o["ok"] for o in out):
                raise SystemExit(f"{method}: a restore was not bit-exact")
            res[method].append(out)
    print(f"### Memory-tier redundancy, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"4 ranks, each its own node, {args.size_mib} MiB per rank; median of {args.reps} reps; every restore "
          "bit-exact.\n")
    print("| method | memory per node (× own data) | save until redundant (s) | restore after losing node 1 (s) |")
    print("|---|---|---|---|")
    for method, reps in res.items():
        held = statistics.median(max(o["held"] for o in out) / out[0]["own"] for out in reps)
        save = statistics.median(max(o["save"] for o in out) for out in reps)
        rest = statistics.median(max(o["restore"] for o in out) for out in reps)
        print(f"| {method} | {held:.2f} | {save:.3f} | {rest:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
