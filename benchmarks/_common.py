"""Helpers shared by the benchmark drivers (``bench_sync.py``, ``bench_async.py``) and their workers.

Importing this module puts ``benchmarks/`` on ``sys.path`` and on ``PYTHONPATH`` so that worker processes
(forkserver children, ``liferaft.testing.run_ranks`` ranks) can import the worker modules.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)

import psutil


def run_solo(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a fresh process (forkserver child, no process group)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "liferaft"])
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args).result()


def drop_cache(root: str) -> None:
    """fsync every file under ``root`` (a folder or one file) and drop it from the page cache."""
    files = [root] if os.path.isfile(root) else \
        [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def small_pages(nbytes: int) -> Any:
    """An anonymous shared mapping of ``nbytes`` kept in 4 KiB pages (``MADV_NOHUGEPAGE``, where THP would
    otherwise back it: shmem THP ``always``): the limits rows that say "O_DIRECT" mean buffers of small pages,
    the rows "from 2 MiB pages" ``liferaft.storage.iobuf``'s."""
    import contextlib
    import mmap

    m = mmap.mmap(-1, nbytes)
    advise = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            m.madvise(advise)
    return m


def dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def machine() -> str:
    """'Linux <release>, <n> CPUs, <x> GiB RAM, torch <version>' for table headers."""
    import torch

    mem = psutil.virtual_memory().total / 2**30
    return (f"Linux {platform.release()}, {len(os.sched_getaffinity(0))} CPUs, {mem:.1f} GiB RAM, "
            f"torch {torch.__version__}")


def append_jsonl(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def med_range(values: Iterable[float], fmt: str = ".2f") -> str:
    """'median [min–max]' of ``values``."""
    v = list(values)
    return f"{statistics.median(v):{fmt}} [{min(v):{fmt}}–{max(v):{fmt}}]"


def cpu_seconds() -> float:
    """CPU seconds (user + system) spent so far by this process, all its threads, and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_now(children: bool = False) -> float:
    """CPU seconds so far of this process (all its threads, and its waited-for children) and, with ``children``,
    of its live child processes too (a checkpoint daemon such as DCP's PROCESS executor: never waited for, so
    ``os.times`` does not count it). Differences of two calls are what the work between them cost."""
    total = cpu_seconds()
    if children:
        for c in psutil.Process().children(recursive=True):
            try:
                t = c.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


def cpu_per_gb(cpu_s: float | None, nbytes: int) -> float | None:
    """CPU seconds per GB (1e9 bytes) of ``nbytes`` processed; None stays None."""
    return None if cpu_s is None else cpu_s / (nbytes / 1e9)


def fmt_cpu(values: Iterable[float | None], fmt: str = ".2f") -> str:
    """A table cell of CPU s/GB: 'median [min–max]' of the values that are not None, '–' if none is."""
    v = [x for x in values if x is not None]
    return med_range(v, fmt) if v else "–"


class PeakRss:
    """Peak RSS of this process (and, with ``children``, the summed RSS of its child processes), sampled every
    10 ms in a thread between ``start()`` and ``stop()``; ``base`` is this process's RSS at ``start()``;
    ``cpu`` is the CPU seconds the sampling thread itself used (to be taken off a CPU measurement)."""

    def __init__(self, children: bool = False) -> None:
        self.proc = psutil.Process()
        self.children = children
        self.base = self.peak = self.child_peak = 0
        self.cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _child_rss(self) -> int:
        total = 0
        for c in self.proc.children(recursive=True):
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _sample(self) -> None:
        self.peak = max(self.peak, self.proc.memory_info().rss)
        if self.children:
            self.child_peak = max(self.child_peak, self._child_rss())

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(0.01):
            self._sample()
        self.cpu = time.thread_time() - t0

    def start(self) -> PeakRss:
        self.base = self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; return the peak RSS above ``base`` in bytes."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak - self.base


def run_and_report(bench: Any) -> int:
    """Run a benchmark object (``run()``, ``report()``, ``cfg``, ``nbytes``, ``tmp``, ``jsonl``, ``run_id``)."""
    os.makedirs(os.path.dirname(bench.jsonl), exist_ok=True)
    print(f"state: d={bench.cfg.d} L={bench.cfg.layers} {bench.nbytes / 1e9:.3f} GB; tmp {bench.tmp}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bench.run()
    bench.report()
    print(f"\n(run {bench.run_id} took {time.perf_counter() - t0:.0f} s; raw data in {bench.jsonl})", file=sys.stderr)
    return 0


def fsync_path(path: str) -> None:
    """fsync one file or folder (what a durable save must have done)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsync_rate(folder: str, nbytes: int) -> float:
    """The device's write limit in the same run: GB/s of one file of ``nbytes`` (whole MiB, at least 1) of random
    bytes written and fsynced in ``folder`` (the file is removed)."""
    blob = os.path.join(folder, "limit.bin")
    buf = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    t0 = time.perf_counter()
    with open(blob, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    rate = len(buf) / (time.perf_counter() - t0) / 1e9
    os.remove(blob)
    return rate
