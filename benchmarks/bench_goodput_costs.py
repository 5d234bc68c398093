"""The goodput model's inputs, measured on this machine: writes the `liferaft plan --costs` file (docs/cli/plan.md).

What one machine can measure, each in fresh processes, medians of ``--reps``:

- ``launch_s``: from spawning a Python process to torch and liferaft imported in it (what every rank of a restarted
  job pays before anything else);
- ``rendezvous_s``: 2 fresh processes meet on a TCPStore (rank 0 serves it) and both have seen each other;
- ``process_groups_s``: ``init_process_group("gloo")`` on that store plus the first all-reduce;
- ``first_step_s``: how much longer the first training step after a (re)start takes than a steady one
  (examples/train_gpt.py's GPT under DDP on the 2 ranks);
- ``snapshot_bps``: bytes per second of training stall of ``liferaft.async_save`` (blocking staging) of
  ``--size-mib`` of fp32 state, after a warm-up save (on a GPU host this is the device-to-host copy; here, a memcpy);
- ``memory_restore_bps`` and ``peer_restore_bps``: a node's bytes per second restored by the memory tier from the
  node's own memory and, after the node's memory is lost, from its peer (benchmarks/bench_restore.py's worker, 2
  ranks each its own simulated node).

What it cannot (one machine, one node, no object store, no failures): the per-node and per-GPU growth of the
rendezvous and the process groups, the rescheduling of a lost node, the failure detection, the remote store's
aggregate bandwidth, the interference of a background save on a GPU training loop; those keep ``Machine``'s
defaults (their sources: docs/cli/plan.md), and the file's ``measured`` list names what was measured. An existing
file is extended (its ``per_step`` section, from bench_steps.py, is kept). Prints the plan at 1k/16k/100k GPUs with
the default and the measured inputs, side by side.

    python benchmarks/bench_goodput_costs.py [--out bench-out/costs.json] [--reps 3] [--size-mib 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid

from _common import ROOT, machine  # sets up the paths

STEPS = 6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(rank: int, port: int, out: str) -> None:
    """One rank of the restart measurement (a fresh process): timestamps of each phase, written to ``out``."""
    marks = {"started": time.time()}
    import torch
    import torch.distributed as dist

    import liferaft  # noqa: F401 - (what a rank of a job using liferaft imports)
    marks["imported"] = time.time()
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, wait_for_workers=True,
                          timeout=datetime.timedelta(seconds=120))
    store.set(f"joined{rank}", "1")
    store.wait(["joined0", "joined1"])
    marks["met"] = time.time()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))
    marks["grouped"] = time.time()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_gpt import build, train_step

    state = build(rank, 2, layout="ddp")
    batches = state["data"].batches()
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        train_step(state, batches)
        steps.append(time.perf_counter() - t0)
    marks["first_step"] = steps[0] - statistics.median(steps[2:])
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(marks, f)


def restart_parts(tmp: str) -> dict[str, float]:
    """One measurement of launch, rendezvous, process groups and first step (2 fresh processes)."""
    port = _port()
    outs = [os.path.join(tmp, f"r{r}.json") for r in range(2)]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), str(port), outs[r]]) for r in range(2)]
    for p in procs:
        if p.wait(timeout=300) != 0:
            raise SystemExit(f"a measuring rank failed (exit status {p.returncode})")
    marks = [json.load(open(o)) for o in outs]
    imported = max(m["imported"] for m in marks)
    met = max(m["met"] for m in marks)
    return {"launch_s": imported - t0, "rendezvous_s": met - imported,
            "process_groups_s": max(m["grouped"] for m in marks) - met,
            "first_step_s": max(0.0, max(m["first_step"] for m in marks))}


def snapshot_bps(size_mib: int, tmp: str) -> float:
    """Bytes per second of stall of a blocking-staging ``async_save`` (after a warm-up save)."""
    import gc

    import torch

    import liferaft

    n = size_mib << 20
    state = {f"w{i}": torch.randn(n // 4 // 8) for i in range(8)}
    opts = liferaft.SaveOptions(staging="blocking")
    stalls = []
    for i in range(3):
        gc.collect()
        t0 = time.perf_counter()
        pending = liferaft.async_save(os.path.join(tmp, f"snap{i}"), state, options=opts)
        stalls.append(time.perf_counter() - t0)
        pending.wait()
    return n / statistics.median(stalls[1:])


def restores(size_mib: int, reps: int) -> tuple[float, float]:
    """(own node, peer) bytes per second per node of a memory-tier restore (bench_restore.py's worker)."""
    import bench_restore as R

    from liferaft.testing import run_ranks

    tag = uuid.uuid4().hex[:8]
    base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-bench-{tag}")
    disk = os.path.join(ROOT, "bench-out", "tmp", f"costs-{tag}")
    os.makedirs(disk, exist_ok=True)
    try:
        outs = run_ranks(R.worker, 2, base, disk, size_mib << 20, reps, timeout=900)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    node = max(o["bytes"] for o in outs)
    own, peer = R.LABELS[0], R.LABELS[1]
    med = {lab: statistics.median(max(o["restore"][lab][i] for o in outs) for i in range(reps)) for lab in (own, peer)}
    return node / med[own], node / med[peer]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "costs.json"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(int(args.child[0]), int(args.child[1]), args.child[2])
        return 0
    from liferaft.cli.plan import DEFAULT_COSTS, load_costs

    tmp = os.path.join(ROOT, "bench-out", "tmp", f"goodput-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp, exist_ok=True)
    try:
        parts = [restart_parts(tmp) for _ in range(args.reps)]
        print(f"restart parts, {args.reps} runs: " + "; ".join(
            f"{k} {', '.join(f'{p[k]:.2f}' for p in parts)}" for k in parts[0]), file=sys.stderr)
        measured = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        measured["snapshot_bps"] = snapshot_bps(args.size_mib, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    measured["memory_restore_bps"], measured["peer_restore_bps"] = restores(args.size_mib, args.reps)
    costs = load_costs(args.out) if os.path.exists(args.out) else json.loads(json.dumps(DEFAULT_COSTS))
    if "machine" not in costs:                  # a file of fixed seconds: its per_step section is kept
        costs = {"machine": {}, **({"per_step": costs["per_step"]} if "per_step" in costs else {})}
    costs["machine"].update({k: float(v) for k, v in measured.items()})
    costs["measured"] = sorted(set(costs.get("measured", [])) | set(measured))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(costs, f, indent=1)
    load_costs(args.out)                        # (what `liferaft plan` will read: checked the same way)
    print(f"### The goodput model's inputs measured here, {datetime.date.today().isoformat()}: {machine()}\n")
    print("| input | default (assumed) | measured here |\n|---|---|---|")
    from liferaft.manager.goodput import Machine

    d = Machine()
    for k, v in measured.items():
        unit = (lambda x: f"{x / 1e9:.2f} GB/s") if k.endswith("_bps") else (lambda x: f"{x:.2f} s")
        print(f"| {k} | {unit(getattr(d, k))} | {unit(v)} |")
    print(f"\nwrote {args.out}; the plan with it (the rest of the inputs at their defaults):\n")
    for label, extra in (("defaults", []), ("measured", ["--costs", args.out])):
        out = subprocess.run([sys.executable, "-m", "liferaft", "plan", *extra], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
        print(f"{label}:\n")
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith("|")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
