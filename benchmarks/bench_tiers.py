"""Restore time from each tier for the same state, and the save stall with and without the memory tier.

Two ranks, each its own simulated node (its own shared-memory namespace under /dev/shm), gloo over 127.0.0.1.
The state: fp32 tensors sharded by rows over the ranks (``--size-gib`` in all, Adam-like: params + 2 moments).
It is saved once to each tier — the memory tier (replicas on the other node), a local disk folder, and
``s3://`` on a moto S3 server started here (HTTP on 127.0.0.1) — then restored ``--reps`` times from each:

- memory, own node: ``MemoryTier.restore`` with every node's namespace intact;
- memory, peer: node 1's namespace deleted first (its node lost): rank 1 gets its files from rank 0's replicas;
- local disk: ``liferaft.load`` after dropping the page cache;
- S3 (moto): ``liferaft.load`` from the object store (compression off on save, to time the transfer, not the codec).

Save stall, with the same state: the call of ``MemoryTier.save`` (returns after the snapshot; the write to shared
memory and the replication run in the background) and of ``liferaft.async_save`` to disk, next to one memcpy of
a rank's state into prefaulted memory (the snapshot copy alone). CPU s/GB next to each: the CPU seconds (every
thread) of both ranks' processes per GB of the whole state, for a save from the call until durable (the background
write and replication included). Every restore is checked bit-exact. Markdown on
stdout; JSON lines in ``bench-out/bench_tiers.jsonl``.
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

import torch
from _common import ROOT, append_jsonl, cpu_now, drop_cache, fmt_cpu, machine  # sets up the paths

ROWS = 4096


def state(rank: int, world: int, nbytes: int, salt: int = 0) -> dict[str, Any]:
    import liferaft

    cols = max(1, nbytes // 3 // 4 // ROWS // 8)
    out: dict[str, Any] = {}
    rows = ROWS // world
    for name in ("param", "exp_avg", "exp_avg_sq"):
        for i in range(8):
            g = torch.Generator().manual_seed(hash((name, i, salt)) % 2**31)
            full = torch.randn(ROWS, cols, generator=g)
            out[f"{name}.{i}"] = liferaft.Sharded(full[rank * rows:(rank + 1) * rows].clone(), (ROWS, cols),
                                                  (rank * rows, 0))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k].local, b[k].local) for k in a)


def zeros(st: dict[str, Any]) -> dict[str, Any]:
    import liferaft

    return {k: liferaft.Sharded(torch.zeros_like(v.local), v.global_shape, v.offsets) for k, v in st.items()}


def worker(rank: int, world: int, base: str, disk: str, s3: str, nbytes: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import liferaft
    from liferaft.tiers.memory import MemoryTier

    tier = MemoryTier("bench", node=f"n{rank}", base=base, replicas=1)
    st = state(rank, world, nbytes)
    out: dict[str, Any] = {"bytes": sum(v.local.numel() * 4 for v in st.values())}
    # -- stall: snapshot copy alone, memory tier save, async_save to disk (each after one warm-up)
    dst = {k: torch.empty_like(v.local) for k, v in st.items()}
    for k, v in st.items():
        dst[k].copy_(v.local)
    memcpy, mem_call, disk_call, mem_cpu, disk_cpu = [], [], [], [], []
    for rep in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for k, v in st.items():
            dst[k].copy_(v.local)
        memcpy.append(time.perf_counter() - t0)
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_now()
        tier.save(rep, st)
        mem_call.append(time.perf_counter() - t0)
        tier.wait()
        mem_cpu.append(cpu_now() - c0)         # the whole save (snapshot, write, replication), every thread
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_now()
        h = liferaft.async_save(os.path.join(disk, f"s{rep}"), st,
                                options=liferaft.SaveOptions(overwrite=True, compression="off"))
        disk_call.append(time.perf_counter() - t0)
        h.wait()
        disk_cpu.append(cpu_now() - c0)
    out["memcpy"], out["memory_call"], out["disk_call"] = memcpy[1:], mem_call[1:], disk_call[1:]
    out["memory_cpu"], out["disk_cpu"] = mem_cpu[1:], disk_cpu[1:]
    liferaft.save(s3, st, options=liferaft.SaveOptions(compression="off"))
    last = os.path.join(disk, f"s{reps}")
    times: dict[str, list[float]] = {"memory, own node": [], "memory, peer (node lost)": [], "local disk": [],
                                     "S3 (moto)": []}
    cpu: dict[str, list[float]] = {label: [] for label in times}
    for _ in range(reps):
        for label in times:
            target = zeros(st)
            if label == "memory, peer (node lost)" and rank == 1:
                shutil.rmtree(tier.root, ignore_errors=True)
            if label == "local disk" and rank == 0:
                drop_cache(last)
            dist.barrier()
            t0, c0 = time.perf_counter(), cpu_now()
            if label.startswith("memory"):
                got = tier.restore(target)
                assert got == reps, got
            elif label == "local disk":
                liferaft.load(last, target)
            else:
                liferaft.load(s3, target)
            cpu[label].append(cpu_now() - c0)       # this rank's process, every thread (not the moto server)
            dist.barrier()
            times[label].append(time.perf_counter() - t0)
            if not same(target, st):
                raise AssertionError(f"{label}: restored state differs")
    out["restore"], out["restore_cpu"] = times, cpu
    tier.release()
    return out


def per_gb(per_rank: list[list[float]], total: int) -> list[float]:
    """Per rep, the CPU seconds of all ranks together per GB of the whole state."""
    return [sum(r[i] for r in per_rank) / (total / 1e9) for i in range(len(per_rank[0]))]


def main(argv: list[str] | None = None) -> int:
    from liferaft.testing import run_ranks
    from liferaft.testing.s3server import MotoS3Server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    nbytes = int(args.size_gib * 2**30)
    base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-bench-{uuid.uuid4().hex[:8]}")
    disk = os.path.join(ROOT, "bench-out", "tmp", f"tiers-{os.getpid()}")
    jsonl = os.path.join(ROOT, "bench-out", "bench_tiers.jsonl")
    os.makedirs(disk, exist_ok=True)
    try:
        with MotoS3Server() as server:
            outs = run_ranks(worker, 2, base, disk, f"s3://{server.bucket}/tiers", nbytes, args.reps,
                             timeout=1800, env=server.env())
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    append_jsonl(jsonl, {"date": datetime.datetime.now().isoformat(), "size": nbytes, "ranks": outs})
    total = sum(o["bytes"] for o in outs)
    print(f"### Tiers, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {total / 1e9:.2f} GB fp32 over 2 ranks (each its own simulated node), {args.reps} reps, median "
          "[min–max] seconds, the slower rank; every restore verified bit-exact.\n")
    print("| restore from | seconds | GB/s | remote (S3) ÷ this | CPU s/GB (both ranks' processes) |")
    print("|---|---|---|---|---|")
    med = {}
    for label in outs[0]["restore"]:
        per_rep = [max(o["restore"][label][i] for o in outs) for i in range(args.reps)]
        med[label] = (statistics.median(per_rep), min(per_rep), max(per_rep))
    for label, (m, lo, hi) in med.items():
        cpu = fmt_cpu(per_gb([o["restore_cpu"][label] for o in outs], total))
        print(f"| {label} | {m:.3f} [{lo:.3f}–{hi:.3f}] | {total / m / 1e9:.2f} | "
              f"{med['S3 (moto)'][0] / m:.1f}× | {cpu} |")
    print("\n| save, per rank | seconds (call returns) | ÷ snapshot memcpy | CPU s/GB, whole save until durable |")
    print("|---|---|---|---|")
    copy = statistics.median(max(o["memcpy"][i] for o in outs) for i in range(args.reps))
    print(f"| memcpy of the rank's state (the snapshot copy alone) | {copy:.3f} | 1.00 | – |")
    for key, label in (("memory", "MemoryTier.save (memory tier)"), ("disk", "liferaft.async_save to disk")):
        v = statistics.median(max(o[f"{key}_call"][i] for o in outs) for i in range(args.reps))
        print(f"| {label} | {v:.3f} | {v / copy:.2f} | {fmt_cpu(per_gb([o[f'{key}_cpu'] for o in outs], total))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
