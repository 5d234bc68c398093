"""Is the 1-thread training loop's slowdown during a background save the GIL, or the machine?

A 1-thread loop of fixed steps (``--k`` matmuls of ``--m``², then ``--small`` tiny in-place ops, each of which
gives the GIL back and takes it again) runs while ``liferaft.async_save`` saves ``--mib`` MiB ``--saves`` times
(gaps of 0.6 s between them). ``--where thread``: the saves run in this process (the loop shares the GIL, the
CPUs and memory with them); ``--where process``: the same saves in a child process (CPUs and memory only, no
shared GIL). Slowdown = mean step that started inside a save ÷ mean step outside the saves in the same run − 1
(the baseline is taken between the saves, so a machine whose load drifts during the run skews both alike). The
step is split into the training thread's own CPU (``time.thread_time``: its work, slower when the save takes
the caches and memory bandwidth) and its wait (the rest: the GIL, or no free core). The GIL's share is
``thread`` − ``process``; run both back to back, several times (``farm-bench`` or a shell loop), and compare.
``--m 1024 --k 2 --small 300 --mib 1024`` is ``bench_async.py``'s loop and state size (~50 ms steps).

    PYTHONPATH=src python benchmarks/bench_gil.py --where thread|process [--saves 6] [--m 1024 --k 2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

import liferaft
from liferaft import SaveOptions

GAP = 0.6


def saves(n: int, mib: int, windows: list[tuple[float, float]]) -> None:
    """``n`` async saves of ``mib`` MiB (8 MiB tensors) into a scratch folder, each window (start, durable)
    appended."""
    state = {f"w{i}": torch.randn(2 << 20) for i in range(max(1, mib // 8))}
    root = tempfile.mkdtemp(prefix="bench-gil-")
    try:
        liferaft.async_save(os.path.join(root, "warm"), state).wait()
        time.sleep(GAP)
        for r in range(n):
            t0 = time.perf_counter()
            liferaft.async_save(os.path.join(root, f"c{r}"), state, options=SaveOptions(overwrite=True)).wait()
            windows.append((t0, time.perf_counter()))
            shutil.rmtree(os.path.join(root, f"c{r}"), ignore_errors=True)
            time.sleep(GAP)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", choices=("thread", "process", "child"), default="thread")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--mib", type=int, default=256, help="state saved, MiB (default 256)")
    ap.add_argument("--m", type=int, default=256, help="matmul size of a step (default 256)")
    ap.add_argument("--k", type=int, default=8, help="matmuls per step (default 8)")
    ap.add_argument("--small", type=int, default=0, help="tiny in-place ops per step (default 0)")
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="sys.setswitchinterval for this process (default: Python's 5 ms): a waiting thread gets "
                         "the GIL from one running Python code after at most this long")
    a = ap.parse_args()
    if a.switch_ms is not None:
        sys.setswitchinterval(a.switch_ms / 1e3)
    torch.set_num_threads(1)
    windows: list[tuple[float, float]] = []
    if a.where == "child":
        saves(a.saves, a.mib, windows)
        print(json.dumps(windows))
        return
    x, y = torch.randn(a.m, a.m), torch.randn(a.m, a.m)
    small = [torch.zeros(64, dtype=torch.int32) for _ in range(a.small)]
    steps: list[tuple[float, float, float]] = []      # (start, wall, thread CPU)
    if a.where == "thread":
        th = threading.Thread(target=saves, args=(a.saves, a.mib, windows))
        th.start()
        alive = th.is_alive
    else:       # perf_counter is CLOCK_MONOTONIC: the child's windows compare with this process's steps
        child = subprocess.Popen([sys.executable, __file__, "--where", "child", "--saves", str(a.saves),
                                  "--mib", str(a.mib)],
                                 stdout=subprocess.PIPE, text=True)
        alive = lambda: child.poll() is None
    while alive():
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(a.k):
            torch.mm(x, y)
        for t in small:
            t.add_(1)
        steps.append((t0, time.perf_counter() - t0, time.thread_time() - c0))
    if a.where == "thread":
        th.join()
    else:
        windows = json.loads(child.communicate()[0])
    first = windows[0][0] - GAP / 2
    inside = [(d, c) for t, d, c in steps if any(s <= t < e for s, e in windows)]
    outside = [(d, c) for t, d, c in steps if t >= first and not any(s - 0.05 <= t < e + 0.05 for s, e in windows)]
    wall_in, wall_out = (statistics.mean(d for d, _ in x) for x in (inside, outside))
    cpu_in, cpu_out = (statistics.mean(c for _, c in x) for x in (inside, outside))
    print(f"{a.where}, switch {sys.getswitchinterval() * 1e3:g} ms: step {statistics.median(d for d, _ in outside) * 1e3:.2f} ms, "
          f"slowdown during save {100 * (wall_in / wall_out - 1):.1f} % (own CPU {(cpu_in - cpu_out) * 1e3:+.2f} ms, "
          f"wait {(wall_in - cpu_in - (wall_out - cpu_out)) * 1e3:+.2f} ms), "
          f"save {statistics.median(e - s for s, e in windows):.2f} s")


if __name__ == "__main__":
    main()
