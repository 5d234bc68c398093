"""How large a load's reads should be: liferaft at several ``max_read_bytes`` against DCP and the device.

One process saves a GPT-like state (``bench_sync``'s, ``--size-gib``) with liferaft and with DCP, then, ``--reps``
times in an interleaved order, drops both from the page cache and times:

- the device: O_DIRECT reads of liferaft's data file in 8 MiB requests into one reused 8 MiB buffer, into two
  alternating 8 MiB buffers, into two alternating 32 MiB buffers, and across a buffer of the file's size (where
  a load's bytes must land in the end), all of 4 KiB pages; and into two alternating buffers of transparent huge
  pages (``storage.iobuf``, what liferaft reads into), in 8 and in 16 MiB requests;
- ``liferaft.load`` into zeroed tensors at ``max_read_bytes`` 4, 8 (the default on a local disk:
  ``storage.posix.DISK_READ_SIZE``), 16 and 32 MiB (the default before 2026-12-07), every load checked bit-exact
  (in one process: repeated loads here favour 16 MiB, a load in a fresh process 8: see ``DISK_READ_SIZE``);
- ``dcp.load`` into the same tensors;
- the device's writes from the sources a save has: O_DIRECT writes + fsync of 1 MiB pieces from one large
  mapping against from 1 MiB tensors torch allocated one by one (each its own mapping), and of 8 MiB pieces of
  one mapping of huge pages (a save's pool, its pieces' writes joined).

Prints seconds (median [min–max]) and CPU seconds per GB. Loads run in this one process (a ``gc.collect()``
before each), unlike ``bench_sync``'s fresh process per operation: compare the rows with each other.

    PYTHONPATH=src python benchmarks/bench_readsize.py [--size-gib 0.5] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import _bench_ranks as W
import torch
from _common import ROOT, cpu_seconds, drop_cache, machine, small_pages  # sets up the paths

MiB = 1 << 20


def _aligned(nbytes: int, huge: bool = False) -> memoryview:
    """A prefaulted page-aligned buffer of 4 KiB pages, or of transparent huge pages (``storage.iobuf``: what
    liferaft's own I/O buffers are)."""
    from liferaft.storage.iobuf import huge_buffer

    if huge:
        v = huge_buffer(nbytes)
        v[:] = b"\0" * nbytes
        return v
    m = small_pages(nbytes)
    m.write(b"\0" * nbytes)                 # (prefaulted)
    return memoryview(m)


def _direct_read(file: str, bufs: list[memoryview], req: int = 8 * MiB) -> None:
    """Read ``file`` (whole pages) by O_DIRECT in ``req`` requests, into ``bufs`` in turn, or across ``bufs[0]``
    when it is as large as the file."""
    n = os.path.getsize(file) // 4096 * 4096
    fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    try:
        across = len(bufs[0]) >= n
        for i, at in enumerate(range(0, n, req)):
            k = min(req, n - at)
            dst = bufs[0][at:at + k] if across else bufs[i % len(bufs)][:k]
            os.preadv(fd, [dst], at)
    finally:
        os.close(fd)


def _direct_write(folder: str, pieces: list[memoryview]) -> None:
    """Write ``pieces`` one after the other, each where the file's page offset is its memory's (as liferaft lays
    out a chunk it writes uncopied), by O_DIRECT (their whole pages) and the page cache (the partial ones), then
    fsync."""
    path = os.path.join(folder, f"w-{uuid.uuid4().hex}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        pos = 0
        for mv in pieces:
            phase = ctypes.addressof(ctypes.c_char.from_buffer(mv)) % 4096 if not mv.readonly else 64
            pos += (phase - pos) % 4096
            lo, hi = -(-pos // 4096) * 4096, (pos + len(mv)) // 4096 * 4096
            os.pwrite(fd, mv[:lo - pos], pos)
            os.pwritev(dfd, [mv[lo - pos:hi - pos]], lo)
            os.pwrite(fd, mv[hi - pos:], hi)
            pos += len(mv)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(dfd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp

    import liferaft

    # (first, while no large block was freed: glibc then maps each 1 MiB tensor on its own, as in a fresh process)
    tensors = [torch.randn(MiB // 4) for _ in range(512)]
    cfg = W.pick_config(args.size_gib)
    work = os.path.join(ROOT, "bench-out", "tmp", f"readsize-{uuid.uuid4().hex[:8]}")
    os.makedirs(work)
    try:
        state = W.build_state(cfg, "full", filled=True)
        lf, dc = os.path.join(work, "liferaft"), os.path.join(work, "dcp")
        liferaft.save(lf, state)
        dcp.save(state, checkpoint_id=dc, no_dist=True)
        nbytes = cfg.nbytes()
        (data,) = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(lf, "data")) for f in fs
                   if f.endswith(".bin")]
        del state
        targets = W.build_state(cfg, "full", filled=False)
        one, two8, two32 = [_aligned(8 * MiB)], [_aligned(8 * MiB) for _ in range(2)], \
            [_aligned(32 * MiB) for _ in range(2)]
        huge_two8, huge_two16 = [_aligned(8 * MiB, True) for _ in range(2)], [_aligned(16 * MiB, True) for _ in range(2)]
        whole = [_aligned(-(-os.path.getsize(data) // 4096) * 4096)]
        big = _aligned(512 * MiB + 8192)
        pieces_big = [big[64 + i * MiB:64 + (i + 1) * MiB] for i in range(512)]
        huge_big = _aligned(512 * MiB + 8192, True)
        huge_8 = [huge_big[64 + i * 8 * MiB:64 + (i + 1) * 8 * MiB] for i in range(64)]
        pieces_tensors = [memoryview(t.numpy()).cast("B") for t in tensors]

        def load(mrb: int | None) -> Callable[[], None]:
            def run() -> None:
                liferaft.load(lf, targets, options=liferaft.LoadOptions(max_read_bytes=mrb))
            return run

        cases: list[tuple[str, Callable[[], None], int]] = [
            ("device: O_DIRECT read, one 8 MiB buffer", lambda: _direct_read(data, one), nbytes),
            ("device: O_DIRECT read, two 8 MiB buffers", lambda: _direct_read(data, two8), nbytes),
            ("device: O_DIRECT read, two 32 MiB buffers", lambda: _direct_read(data, two32), nbytes),
            ("device: O_DIRECT read across a buffer of the file's size", lambda: _direct_read(data, whole), nbytes),
            ("device: O_DIRECT read, two 8 MiB buffers of 2 MiB pages", lambda: _direct_read(data, huge_two8),
             nbytes),
            ("device: O_DIRECT read, two 16 MiB buffers of 2 MiB pages, 16 MiB requests",
             lambda: _direct_read(data, huge_two16, 16 * MiB), nbytes),
            ("liferaft.load, max_read_bytes 4 MiB", load(4 * MiB), nbytes),
            ("liferaft.load, max_read_bytes 8 MiB (default)", load(None), nbytes),
            ("liferaft.load, max_read_bytes 16 MiB", load(16 * MiB), nbytes),
            ("liferaft.load, max_read_bytes 32 MiB (the default before 2026-12-07)", load(32 * MiB), nbytes),
            ("dcp.load", lambda: dcp.load(targets, checkpoint_id=dc, no_dist=True), nbytes),
            ("device: O_DIRECT write of 1 MiB pieces from one mapping", lambda: _direct_write(work, pieces_big),
             512 * MiB),
            ("device: O_DIRECT write of 1 MiB tensors, each its own mapping",
             lambda: _direct_write(work, pieces_tensors), 512 * MiB),
            ("device: O_DIRECT write of 8 MiB pieces from one mapping of 2 MiB pages",
             lambda: _direct_write(work, huge_8), 512 * MiB),
        ]
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        cpus: dict[str, list[float]] = {c[0]: [] for c in cases}
        for rep in range(args.reps):
            order = cases[rep % len(cases):] + cases[:rep % len(cases)]
            for name, fn, n in order:
                drop_cache(lf)
                drop_cache(dc)
                gc.collect()
                c0, t0 = cpu_seconds(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpus[name].append((cpu_seconds() - c0) / (n / 1e9))
                if name.startswith(("liferaft", "dcp")):
                    W.verify(targets, cfg, name)
                    for _, _, t in W.leaves_of(targets, cfg):
                        t.zero_()
            print(f"  rep {rep} done", file=sys.stderr, flush=True)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"### Read size, {now}: {machine()}\n\n{nbytes / 1e9:.2f} GB state ({len(cfg.leaves())} fp32 "
              f"tensors), {args.reps} reps interleaved, cold (page cache dropped before each); one process.\n")
        print("| operation | seconds | GB/s | CPU s/GB |\n|---|---|---|---|")
        for name, _, n in cases:
            ts = times[name]
            med = statistics.median(ts)
            print(f"| {name} | {med:.3f} [{min(ts):.3f}–{max(ts):.3f}] | {n / med / 1e9:.2f} | "
                  f"{statistics.median(cpus[name]):.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
