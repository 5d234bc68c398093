"""Compressed saves and loads: liferaft vs PyTorch DCP with its zstd extension, same state, same run, with the
machine's limits measured beside them.

State: ``--size-mib`` of fp32 tensors of ``--tensor-mib`` each, seeded, alternately weight-like (N(0, 0.02²)) and
second-moment-like ((N(0, 10⁻³))²) values: what a lossless codec meets in a training state (bench_codec.py
measures liferaft's ratio on real weights). One process, no process group.

Methods, each rep in a rotated order, a full ``gc.collect()`` before each timed call:
- ``liferaft zstd``: ``liferaft.save(..., SaveOptions(compression="on"))`` (byte planes + zstd-1 per hash block,
  encoded on a codec thread per core, since training waits for a sync save, pipelined with hashing and writing);
- ``liferaft raw``: the same save with ``compression="off"``;
- ``DCP zstd``: ``dcp.save`` through ``FileSystemWriter(_extensions=[ZStandard()])`` (its defaults otherwise: one
  writer thread, fsync);
- ``DCP raw``: ``dcp.save`` with the default writer;
- limits: ``encode only`` (liferaft's codec on the same bytes, same threads, nothing written: the CPU floor of a
  compressed save) and ``write limit`` (O_DIRECT write + fsync of as many bytes as liferaft stored compressed,
  8 MiB requests, one in flight). A pipelined save takes about max(encode, write), a serial one their sum.
Loads (cold: fsync + ``posix_fadvise(DONTNEED)`` of every file first) of each of the four checkpoints into
pre-allocated tensors, checked bit-exact against the state.

**CPU s/GB** is the process's CPU time (every thread) during the call ÷ GB of state; it does not depend on the
disk's hour, unlike the wall time.

Output: a markdown table on stdout (median [min–max] over reps), one JSON line per measurement appended to
``bench-out/bench_compressed_save.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import ROOT, append_jsonl, dir_bytes, drop_cache, machine, med_range, small_pages

import liferaft
from liferaft import LoadOptions, SaveOptions

SAVES = ("liferaft zstd", "liferaft raw", "DCP zstd", "DCP raw")
LOADS = SAVES


def build(size_mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, size_mib // tensor_mib)
    numel = tensor_mib << 18                    # fp32 elements in tensor_mib MiB
    out = {}
    for i in range(n):
        t = torch.randn(numel, generator=g)
        out[f"t{i:04d}"] = t.mul_(0.02) if i % 2 == 0 else t.mul_(1e-3).square_()
    return out


def save(method: str, path: str, state: dict[str, torch.Tensor]) -> None:
    """Save ``state`` to ``path`` with ``method``, durable on return."""
    if method.startswith("liferaft"):
        liferaft.save(path, state, options=SaveOptions(compression="on" if "zstd" in method else "off"))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()] if "zstd" in method else None)
    dcp.save(state, storage_writer=writer, no_dist=True)


def load(method: str, path: str, targets: dict[str, torch.Tensor]) -> None:
    if method.startswith("liferaft"):
        liferaft.load(path, targets, options=LoadOptions())
        return
    import torch.distributed.checkpoint as dcp

    dcp.load(targets, checkpoint_id=path, no_dist=True)


def encode_only(state: dict[str, torch.Tensor]) -> int:
    """liferaft's lossless codec over every tensor's hash blocks, as a sync save runs it; returns the bytes out."""
    from liferaft.codecs import frames, registry
    from liferaft.codecs.checksum import choose_block_size

    codec, pool, n = registry.get(registry.LOSSLESS), frames.executor(foreground=True), 0
    for t in state.values():
        mv = memoryview(t.numpy()).cast("B")
        bs = choose_block_size(len(mv), None)
        enc = codec.encode_chunk([mv[i:i + bs] for i in range(0, len(mv), bs)], "float32", pool, frames.PAYS_RATIO)
        n += len(mv) if enc is None else sum(len(f) for f in enc.frames)
    return n


def write_limit(file: str, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (rounded up to whole pages) from the prefaulted page-aligned ``buf`` in 8 MiB
    requests, one in flight, plus fsync: with O_DIRECT, or through the page cache where O_DIRECT is refused."""
    total = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    view, req = memoryview(buf), 8 << 20
    t0 = time.perf_counter()
    try:
        for at in range(0, total, req):
            os.pwrite(fd, view[:min(req, total - at)], at)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(file)
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, CPU s of the process, result) of ``fn()``, after a full collection (see benchmarks/README.md)."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench-out"),
                    help="under which a temporary folder for the checkpoints is made")
    ap.add_argument("--jsonl", default=os.path.join(ROOT, "bench-out", "bench_compressed_save.jsonl"))
    args = ap.parse_args(argv)
    state = build(args.size_mib, args.tensor_mib)
    nbytes = sum(t.nbytes for t in state.values())
    gb = nbytes / 1e9
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    for t in targets.values():
        t.fill_(1.0)                                        # (first touch outside the timed loads)
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-compressed-", dir=args.dir)
    rows: dict[str, dict[str, list[float]]] = {}
    stored: dict[str, list[int]] = {m: [] for m in SAVES}
    run_id = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    buf = small_pages(64 << 20)
    buf.write(b"\0" * len(buf))                             # (a prefaulted, page-aligned source for the limit)

    def record(what: str, rep: int, wall: float, cpu: float, **extra: Any) -> None:
        rows.setdefault(what, {"wall": [], "cpu": []})
        rows[what]["wall"].append(wall)
        rows[what]["cpu"].append(cpu)
        append_jsonl(args.jsonl, {"bench": "compressed_save", "run": run_id, "what": what, "rep": rep,
                                  "wall_s": wall, "cpu_s": cpu, "bytes": nbytes, **extra})

    try:
        for method in SAVES:                                # untimed warm-up: pools, threads, page faults
            save(method, os.path.join(root, "warm"), state)
            shutil.rmtree(os.path.join(root, "warm"))
        encode_only(state)
        for rep in range(args.reps):
            order = SAVES[rep % len(SAVES):] + SAVES[:rep % len(SAVES)]
            paths = {}
            for method in order:
                path = paths[method] = os.path.join(root, f"r{rep}-{method.replace(' ', '-')}")
                wall, cpu, _ = timed(lambda: save(method, path, state))
                stored[method].append(dir_bytes(path))
                record(f"save {method}", rep, wall, cpu, stored=stored[method][-1])
                print(f"rep {rep} save {method}: {wall:.3f} s, {cpu / gb:.2f} CPU s/GB, "
                      f"stored {stored[method][-1] / nbytes:.3f}", file=sys.stderr, flush=True)
            wall, cpu, out = timed(lambda: encode_only(state))
            record("encode only", rep, wall, cpu, stored=out)
            n = stored["liferaft zstd"][-1]
            wall = write_limit(os.path.join(root, "limit.bin"), buf, n)
            record("write limit", rep, wall, 0.0, stored=n)
            for method in LOADS:
                drop_cache(paths[method])
                wall, cpu, _ = timed(lambda: load(method, paths[method], targets))
                bad = [k for k, v in state.items() if not torch.equal(targets[k].view(torch.int32),
                                                                        v.view(torch.int32))]
                if bad:
                    raise SystemExit(f"{method}: the checkpoint does not load bit-exact ({bad[:3]})")
                for t in targets.values():
                    t.fill_(1.0)
                record(f"load {method}", rep, wall, cpu)
            for path in paths.values():
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(rows, stored, nbytes, args))
    return 0


def report(rows: dict[str, dict[str, list[float]]], stored: dict[str, list[int]], nbytes: int,
           args: argparse.Namespace) -> str:
    gb = nbytes / 1e9

    def med(what: str) -> float:
        return statistics.median(rows[what]["wall"])

    lines = [f"Compressed saves and loads, {gb:.3f} GB of fp32 ({args.size_mib // args.tensor_mib} tensors of "
             f"{args.tensor_mib} MiB), {args.reps} reps, median [min–max]; {machine()}, "
             f"{datetime.date.today().isoformat()}", "",
             "| what | wall (s) | GB/s of state | CPU s/GB | stored / raw | ÷ liferaft zstd (save or load) |", "|---|---|---|---|---|---|"]
    ref, lref = med("save liferaft zstd"), med("load liferaft zstd")
    for what, r in rows.items():
        method = what.removeprefix("save ")
        ratio = f"{statistics.median(stored[method]) / nbytes:.3f}" if method in stored else ""
        cpu = med_range([c / gb for c in r["cpu"]]) if any(r["cpu"]) else "—"
        vs = f"{statistics.median(r['wall']) / (ref if what.startswith('save') else lref):.2f}×" \
            if what.startswith(("save", "load")) else ""
        lines.append(f"| {what} | {med_range(r['wall'], '.3f')} | {gb / med(what):.2f} | {cpu} | {ratio} | {vs} |")
    enc, write, raw = med("encode only"), med("write limit"), med("save liferaft raw")
    cpu = statistics.median(rows["save liferaft zstd"]["cpu"]) / len(os.sched_getaffinity(0))
    lines += ["", f"Pipelining: the compressed save took {ref:.3f} s, {ref / max(enc, write):.2f}× max(encode only, "
              f"write limit) = {max(enc, write):.3f} s (encoding and writing fully overlapped, nothing else costing) "
              f"and {ref / (raw + enc):.2f}× (raw save + encode only) = {raw + enc:.3f} s (one after the other); "
              f"its CPU time ÷ the cores is {cpu:.3f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
