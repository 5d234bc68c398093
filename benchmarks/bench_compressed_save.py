"""Compressed synchronous save (``SaveOptions(compression="on")``): wall time and CPU seconds per GB saved.

State: ``--size-mib`` of fp32 tensors of ``--tensor-mib`` each, seeded, alternately weight-like (N(0, 0.02²)) and
second-moment-like ((N(0, 10⁻³))²) values: what the lossless codec (byte planes + zstd-1 per hash block) meets in
a training state (bench_codec.py measures its ratio on real weights). One process, no process group.

Protocol: one untimed save first (pool, codec threads, page faults), then ``--reps`` timed saves, each of a fresh
checkpoint folder (deleted after it), fsync included (``liferaft.save`` is durable on return). **CPU s/GB** is the
process's CPU time (every thread: staging, hashing, encoding, writing) during the call ÷ GB of state saved; it does
not depend on the disk's hour, unlike the wall time. The saved bytes are checked bit-exact after the last rep.

Output: a markdown row per figure on stdout (median [min–max] over reps), one JSON line per rep on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import liferaft
from liferaft import SaveOptions


def build(size_mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, size_mib // tensor_mib)
    numel = tensor_mib << 18                    # fp32 elements in tensor_mib MiB
    out = {}
    for i in range(n):
        t = torch.randn(numel, generator=g)
        out[f"t{i:04d}"] = t.mul_(0.02) if i % 2 == 0 else t.mul_(1e-3).square_()
    return out


def med(xs: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}–{max(xs):{fmt}}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary folder)")
    args = ap.parse_args(argv)
    state = build(args.size_mib, args.tensor_mib)
    nbytes = sum(t.nbytes for t in state.values())
    root = tempfile.mkdtemp(prefix="bench-compressed-", dir=args.dir)
    opts = SaveOptions(compression="on")
    try:
        liferaft.save(os.path.join(root, "warm"), state, options=opts)
        shutil.rmtree(os.path.join(root, "warm"))
        wall, cpu, written = [], [], []
        for rep in range(args.reps):
            path = os.path.join(root, f"r{rep}")
            c0, t0 = time.process_time(), time.perf_counter()
            r = liferaft.save(path, state, options=opts)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            written.append(r.bytes_written)
            print(json.dumps({"rep": rep, "wall_s": wall[-1], "cpu_s": cpu[-1], "bytes": nbytes,
                              "bytes_written": r.bytes_written}), file=sys.stderr)
            if rep < args.reps - 1:
                shutil.rmtree(path)
        got = {k: torch.empty_like(v) for k, v in state.items()}
        liferaft.load(path, got)
        if not all(torch.equal(got[k].view(torch.int32), v.view(torch.int32)) for k, v in state.items()):
            raise SystemExit("the compressed checkpoint does not load bit-exact")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"Compressed sync save, {gb:.3f} GB of fp32 ({len(state)} tensors of {args.tensor_mib} MiB), "
          f"{args.reps} reps, median [min–max]; stored {statistics.median(written) / nbytes:.3f} of the raw bytes\n")
    print("| figure | value |\n|---|---|")
    print(f"| wall (s) | {med(wall)} |")
    print(f"| GB/s of state | {med([gb / w for w in wall], '.2f')} |")
    print(f"| CPU s/GB | {med([c / gb for c in cpu], '.2f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
