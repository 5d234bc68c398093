"""Cold loads by liferaft's default read path, against each path forced and against PyTorch DCP, on 2 ranks.

Two ranks (gloo, 127.0.0.1) save the same row-sharded fp32 state (``--size-mib`` in all, Adam-like: params + 2
moments) once with liferaft and once with DCP on the local disk, then load it ``--reps`` times, interleaved (in a
balanced order: over every 4 reps each method follows each other once), each load after dropping the page cache
of both checkpoints (fsync + ``POSIX_FADV_DONTNEED``), into zeroed tensors:

- liferaft.load, default: the path the device's probe picks (``storage/iopath.choose``: O_DIRECT unless the
  page cache was faster by ``CACHE_MARGIN``, 1.5x);
- liferaft.load with ``PosixStorage(direct_io=True, inflight=1)`` (O_DIRECT, one request in flight) and with
  ``direct_io=False`` (the page cache): each path forced, no probe;
- ``torch.distributed.checkpoint.load`` (buffered reads, as DCP does).

Every liferaft load is checked bit-exact. Seconds: the slower rank's; CPU: both ranks' process CPU (every
thread) per GB loaded. Prints the path the probe chose on each rank.

    PYTHONPATH=src python benchmarks/bench_readpath.py [--size-mib 1024] [--reps 6]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import statistics
import sys
import time
import uuid
from typing import Any

import torch
from _common import ROOT, drop_cache, machine  # sets up the paths
from bench_restore import state

METHODS = ("liferaft, default (the probe's path)", "liferaft, O_DIRECT forced", "liferaft, page cache forced", "DCP")


def worker(rank: int, world: int, disk: str, nbytes: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import liferaft
    from liferaft.storage import PosixStorage, iopath

    st = state(rank, world, nbytes)
    lf, dc = os.path.join(disk, "liferaft"), os.path.join(disk, "dcp")
    liferaft.save(lf, st, options=liferaft.SaveOptions(compression="off"))
    dcp.save({f"{k}@{rank}": v.local for k, v in st.items()}, checkpoint_id=dc)
    loads = {
        METHODS[0]: lambda t: liferaft.load(lf, t),
        METHODS[1]: lambda t: liferaft.load(PosixStorage(lf, direct_io=True, inflight=1), t),
        METHODS[2]: lambda t: liferaft.load(PosixStorage(lf, direct_io=False, inflight=1), t),
        METHODS[3]: lambda t: dcp.load({f"{k}@{rank}": v.local for k, v in t.items()}, checkpoint_id=dc),
    }
    out: dict[str, Any] = {m: [] for m in METHODS}
    for rep in range(reps):
        # a method that follows a page-cache load gets the pages that load's drop just freed, warm, while one after
        # an O_DIRECT load may touch fresh page-cache memory (~1 GB/s on these VMs): over every 4 reps each method
        # follows each other method once (``balanced_order``)
        for method in (METHODS[i] for i in balanced_order(len(METHODS), rep)):
            fn = loads[method]
            target = {k: liferaft.Sharded(torch.zeros_like(v.local), v.global_shape, v.offsets) for k, v in st.items()}
            if rank == 0:
                drop_cache(disk)
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(target)
            cpu = time.process_time() - c0
            dist.barrier()
            out[method].append((time.perf_counter() - t0, cpu))
            if not all(torch.equal(target[k].local, st[k].local) for k in st):
                raise AssertionError(f"{method}: loaded state differs")
    c = iopath.choice_for(disk)
    out["choice"] = f"{'O_DIRECT' if c.read_direct else 'page cache'}, {c.read_inflight} in flight"
    out["bytes"] = sum(v.local.numel() * 4 for v in st.values())
    return out


def balanced_order(n: int, rep: int) -> list[int]:
    """Rep ``rep``'s order of ``n`` (even) methods, a row of a Williams design: over ``n`` consecutive reps every
    method runs once at each position and follows every other method exactly once (a plain rotation keeps who
    follows whom)."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    return [(i + rep) % n for i in first]


def main(argv: list[str] | None = None) -> int:
    from liferaft.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv)
    disk = os.path.join(ROOT, "bench-out", "tmp", f"readpath-{uuid.uuid4().hex[:8]}")
    os.makedirs(disk, exist_ok=True)
    try:
        outs = run_ranks(worker, 2, disk, args.size_mib << 20, args.reps, timeout=1800)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    total = sum(o["bytes"] for o in outs)
    print(f"### Cold loads by read path, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {total / 2**20:.0f} MiB fp32 over 2 ranks, {args.reps} interleaved reps (balanced order), "
          "median [min–max] seconds "
          "of the slower rank; page cache dropped before every load; every liferaft load verified bit-exact.\n")
    print("| load | seconds | GB/s | CPU s per GB | ÷ DCP |")
    print("|---|---|---|---|---|")
    walls = {m: [max(o[m][i][0] for o in outs) for i in range(args.reps)] for m in METHODS}
    for m in METHODS:
        w = walls[m]
        cpu = statistics.median(sum(o[m][i][1] for o in outs) for i in range(args.reps)) / (total / 1e9)
        print(f"| {m} | {statistics.median(w):.3f} [{min(w):.3f}–{max(w):.3f}] | "
              f"{total / statistics.median(w) / 1e9:.2f} | {cpu:.2f} | "
              f"{statistics.median(w) / statistics.median(walls['DCP']):.2f} |")
    for rank, o in enumerate(outs):
        print(f"\nrank {rank}: the probe chose reads by {o['choice']}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
