"""Memory-tier restore speed: own node's memory and a peer's memory vs a load from local disk (liferaft and DCP).

Two ranks, each its own simulated node (its own shared-memory namespace under /dev/shm), gloo over 127.0.0.1.
The state: fp32 tensors sharded by rows over the ranks (``--size-mib`` in all, Adam-like: params + 2 moments). It
is saved to the memory tier (one replica on the other node), to a local disk folder with liferaft and with
PyTorch DCP, then restored ``--reps`` times from each into zeroed (prefaulted) tensors:

- memory, own node (process killed): ``MemoryTier.restore`` with every node's namespace intact;
- memory, peer (node lost): node 1's namespace deleted first: rank 1's bytes come from rank 0's replica;
- local disk, liferaft / DCP: ``liferaft.load`` / ``torch.distributed.checkpoint.load`` after dropping the page
  cache of the files;
- limit, gloo: rank 0 sends as many bytes as rank 1 holds, one message per tensor, over the same process group
  (gloo, 127.0.0.1), received into rank 1's tensors: the bound of a restore from a peer's memory here (the data
  differ, so that row alone is not compared);
- limit, memcpy: each rank ``copy_``s the same bytes into the same kind of destination (zeroed, so prefaulted, tensors)
  with no reading, checking or planning: the memory speed a restore can approach on this machine, measured in the
  same run (the destinations of every row are prefaulted the same way, so first touches of fresh memory, ~1 GB/s
  on these VMs, cost none of them).

Every restore is checked bit-exact (the gloo limit row excepted). GB/s per node = the node's bytes / the slower
rank's seconds (each node holds one rank here); "of the memcpy limit" = the limit row's seconds / the row's; CPU s per GB = both ranks' process
CPU seconds (every thread, gloo's included) / the GB restored. Prints the README's markdown tables: the restore
table, and the phases of each liferaft restore (``LoadResult.timings``) to show where the time goes.
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

ROWS = 4096
LABELS = ("memory, own node (process killed)", "memory, peer (node lost)", "local disk, liferaft.load",
          "local disk, DCP load", "limit: gloo, a node's bytes from the peer into the same tensors",
          "limit: memcpy into the same tensors")
LIMIT = LABELS[-1]
NET = LABELS[-2]
PHASES = ("plan", "read", "checksum", "apply")


def state(rank: int, world: int, nbytes: int) -> dict[str, Any]:
    import liferaft

    cols = max(1, nbytes // 3 // 4 // ROWS // 8)
    out: dict[str, Any] = {}
    rows = ROWS // world
    for name in ("param", "exp_avg", "exp_avg_sq"):
        for i in range(8):
            g = torch.Generator().manual_seed(hash((name, i)) % 2**31)
            full = torch.randn(ROWS, cols, generator=g)
            out[f"{name}.{i}"] = liferaft.Sharded(full[rank * rows:(rank + 1) * rows].clone(), (ROWS, cols),
                                                  (rank * rows, 0))
    return out


def worker(rank: int, world: int, base: str, disk: str, nbytes: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import liferaft
    from liferaft.tiers.memory import MemoryTier

    tier = MemoryTier("bench", node=f"n{rank}", base=base, replicas=1)
    st = state(rank, world, nbytes)
    plain = {f"{k}@{rank}": v.local for k, v in st.items()}
    lf, dc = os.path.join(disk, "liferaft"), os.path.join(disk, "dcp")
    liferaft.save(lf, st, options=liferaft.SaveOptions(compression="off"))
    dcp.save(plain, checkpoint_id=dc)
    times: dict[str, list[float]] = {label: [] for label in LABELS}
    cpu: dict[str, list[float]] = {label: [] for label in LABELS}
    phases: dict[str, list[dict[str, float]]] = {label: [] for label in LABELS}
    for rep in range(reps):
        tier.save(rep, st, wait=True)
        dist.barrier()
        for label in LABELS:
            target = {k: liferaft.Sharded(torch.zeros_like(v.local), v.global_shape, v.offsets) for k, v in st.items()}
            if label.startswith("memory, peer") and rank == 1:
                shutil.rmtree(tier.root, ignore_errors=True)
            if label.startswith("local disk") and rank == 0:
                drop_cache(disk)
            gc.collect()                # (as timeit does: no row pays for a GC pass owed to earlier objects)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if label == LIMIT:          # the same bytes into the same (prefaulted) tensors, no checks: the bound
                for k, v in st.items():
                    target[k].local.copy_(v.local)
            elif label == NET:          # the peer path's network: rank 0 sends as many bytes as rank 1 restores
                works = [dist.isend(v.local, 1) if rank == 0 else dist.irecv(target[k].local, 0)
                         for k, v in sorted(st.items())]
                for w in works:
                    w.wait()
            elif label.startswith("memory"):
                got = tier.restore(target)
                assert got == rep, (got, rep)
                phases[label].append(dict(tier.last_load.timings))
            elif "liferaft" in label:
                phases[label].append(dict(liferaft.load(lf, target).timings))
            else:
                dcp.load({f"{k}@{rank}": v.local for k, v in target.items()}, checkpoint_id=dc)
            cpu[label].append(time.process_time() - c0)     # this rank's process, all its threads
            dist.barrier()
            times[label].append(time.perf_counter() - t0)
            if label != NET and not all(torch.equal(target[k].local, st[k].local) for k in st):
                raise AssertionError(f"{label}: restored state differs")
    tier.release()
    return {"bytes": sum(v.local.numel() * 4 for v in st.values()), "restore": times, "cpu": cpu, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    from liferaft.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    nbytes = args.size_mib << 20
    tag = uuid.uuid4().hex[:8]
    base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-bench-{tag}")
    disk = os.path.join(ROOT, "bench-out", "tmp", f"restore-{tag}")
    os.makedirs(disk, exist_ok=True)
    try:
        outs = run_ranks(worker, 2, base, disk, nbytes, args.reps, timeout=900)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    total = sum(o["bytes"] for o in outs)
    node = max(o["bytes"] for o in outs)
    print(f"### Memory-tier restore, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {total / 2**20:.0f} MiB fp32 over 2 ranks (each its own simulated node), {args.reps} reps, median "
          "[min–max] seconds of the slower rank; every restore verified bit-exact.\n")
    print("| restore from | seconds | GB/s per node | of the memcpy limit | CPU s per GB | ÷ liferaft.load from disk |")
    print("|---|---|---|---|---|---|")
    med = {}
    for label in LABELS:
        per_rep = [max(o["restore"][label][i] for o in outs) for i in range(args.reps)]
        med[label] = (statistics.median(per_rep), min(per_rep), max(per_rep))
    for label, (m, lo, hi) in med.items():
        cpu = statistics.median(sum(o["cpu"][label][i] for o in outs) for i in range(args.reps)) / (total / 1e9)
        print(f"| {label} | {m:.3f} [{lo:.3f}–{hi:.3f}] | {node / m / 1e9:.2f} | {med[LIMIT][0] / m:.2f} | "
              f"{cpu:.2f} | {m / med['local disk, liferaft.load'][0]:.2f} |")
    print("\nPhases (median seconds of the slower rank; checksum is part of read, overlapped with it; the rest of a "
          "memory-tier restore is its listing exchange):\n")
    print("| restore from | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for label in LABELS:
        if outs[0]["phases"][label]:
            cells = [statistics.median(max(o["phases"][label][i].get(ph, 0.0) for o in outs)
                                       for i in range(args.reps)) for ph in PHASES]
            print(f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
