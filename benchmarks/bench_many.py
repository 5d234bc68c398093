"""Many small tensors: liferaft vs PyTorch DCP and torch.save on a state of N tensors of a few hundred bytes each.

A model's norms and biases, the optimizer's per-parameter ``step`` scalars, an MoE's many experts' small
tensors: the per-tensor cost of a checkpoint library (planning, metadata, one write per tensor) shows here,
not in the GB/s of the big-tensor benchmarks. The state: ``{"m": {"k<i>": tensor}}`` with ``--keys`` tensors
of 1 to 256 float32 elements (sizes cycling, ~0.5 KiB on average), as one process with no process group.

Each method saves (with fsync: DCP's writer fsyncs, torch.save gets an explicit fsync of its file) and loads in
place into pre-allocated tensors (torch.load returns new ones), each timed operation in a fresh process
(forkserver child) after a full ``gc.collect()``; every load is checked bit-exact (a wrong load aborts). Wall
seconds, microseconds per tensor, CPU seconds of the process; median over ``--reps`` interleaved reps.

    python benchmarks/bench_many.py [--keys 20000] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import cpu_seconds, fsync_path, machine, run_solo  # sets up the paths

METHODS = ("liferaft", "dcp", "torch")
TITLE = {"liferaft": "liferaft", "dcp": "DCP", "torch": "torch.save / torch.load"}


def _state(keys: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {"m": {f"k{i}": torch.randn(1 + (i * 37) % 256, generator=g) for i in range(keys)}}


def _empty(keys: int) -> dict[str, Any]:
    import torch

    return {"m": {f"k{i}": torch.zeros(1 + (i * 37) % 256) for i in range(keys)}}


def _save(method: str, path: str, keys: int) -> tuple[float, float]:
    state = _state(keys)
    gc.collect()
    c0, t0 = cpu_seconds(), time.perf_counter()
    if method == "liferaft":
        import liferaft

        liferaft.save(path, state)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path)
    else:
        import torch

        torch.save(state, path)
        fsync_path(path)
        fsync_path(os.path.dirname(path))
    return time.perf_counter() - t0, cpu_seconds() - c0


def _load(method: str, path: str, keys: int) -> tuple[float, float]:
    import torch

    want = _state(keys)
    into = _empty(keys)
    gc.collect()
    c0, t0 = cpu_seconds(), time.perf_counter()
    if method == "liferaft":
        import liferaft

        liferaft.load(path, into)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(into, checkpoint_id=path)
    else:
        into = torch.load(path, weights_only=True)
    took = time.perf_counter() - t0, cpu_seconds() - c0
    for k, t in want["m"].items():
        if not torch.equal(into["m"][k], t):
            raise SystemExit(f"{method}: key m.{k} loaded wrong")
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not set(methods) <= set(METHODS) or args.keys < 1 or args.reps < 1:
        ap.error(f"methods are {', '.join(METHODS)}; --keys and --reps at least 1")
    tmp = tempfile.mkdtemp(prefix="bench-many-", dir=os.environ.get("BENCH_TMP"))
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    nbytes = sum(t.numel() * 4 for t in _state(args.keys)["m"].values())
    try:
        for rep in range(args.reps):
            for m in methods if rep % 2 == 0 else list(reversed(methods)):
                path = os.path.join(tmp, f"{m}-{rep}" + (".pt" if m == "torch" else ""))
                for op, fn in (("save", _save), ("load", _load)):
                    r = run_solo(fn, m, path, args.keys)
                    got.setdefault((m, op), []).append(r)
                    print(f"rep {rep} {m} {op}: {r[0]:.3f} s, CPU {r[1]:.3f} s", file=sys.stderr, flush=True)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"### Many small tensors, {now}: {machine()}\n\n{args.keys} float32 tensors of 1–256 elements "
          f"({nbytes / 1e6:.1f} MB), 1 process; median of {args.reps} reps, each operation in a fresh process.\n")
    print("| method | save (s) | µs per tensor | CPU (s) | load (s) | µs per tensor | CPU (s) | save ÷ liferaft | "
          "load ÷ liferaft |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in got.items()}
    for m in methods:
        s, lo = med[(m, "save")], med[(m, "load")]
        ratio = ("–", "–") if m == "liferaft" or "liferaft" not in methods else \
            (f"**{s[0] / med[('liferaft', 'save')][0]:.2f}×**", f"**{lo[0] / med[('liferaft', 'load')][0]:.2f}×**")
        print(f"| {TITLE[m]} | {s[0]:.3f} | {s[0] / args.keys * 1e6:.0f} | {s[1]:.3f} | {lo[0]:.3f} | "
              f"{lo[0] / args.keys * 1e6:.0f} | {lo[1]:.3f} | {ratio[0]} | {ratio[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
