"""Is the 1-thread training loop's slowdown during a background save the GIL, or the machine?

A 1-thread loop of fixed matmul steps runs while ``liferaft.async_save`` saves 256 MiB ``--saves`` times (gaps of
0.6 s between them). ``--where thread``: the saves run in this process (the loop shares the GIL, the CPUs and
memory with them); ``--where process``: the same saves in a child process (CPUs and memory only, no shared GIL).
Slowdown = mean step that started inside a save ÷ mean step outside the saves in the same run − 1 (the baseline
is taken between the saves, so a machine whose load drifts during the run skews both alike). The GIL's share is
``thread`` − ``process``; run both back to back, several times (``farm-bench`` or a shell loop), and compare.

    PYTHONPATH=src python benchmarks/bench_gil.py --where thread|process [--saves 6]
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


def saves(n: int, windows: list[tuple[float, float]]) -> None:
    """``n`` async saves of 256 MiB into a scratch folder, each window (start, durable) appended."""
    state = {f"w{i}": torch.randn(2 << 20) for i in range(32)}
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
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="sys.setswitchinterval for this process (default: Python's 5 ms): a waiting thread gets "
                         "the GIL from one running Python code after at most this long")
    a = ap.parse_args()
    if a.switch_ms is not None:
        sys.setswitchinterval(a.switch_ms / 1e3)
    torch.set_num_threads(1)
    windows: list[tuple[float, float]] = []
    if a.where == "child":
        saves(a.saves, windows)
        print(json.dumps(windows))
        return
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    steps: list[tuple[float, float]] = []
    if a.where == "thread":
        th = threading.Thread(target=saves, args=(a.saves, windows))
        th.start()
        alive = th.is_alive
    else:       # perf_counter is CLOCK_MONOTONIC: the child's windows compare with this process's steps
        child = subprocess.Popen([sys.executable, __file__, "--where", "child", "--saves", str(a.saves)],
                                 stdout=subprocess.PIPE, text=True)
        alive = lambda: child.poll() is None
    while alive():
        t0 = time.perf_counter()
        for _ in range(8):
            torch.mm(x, y)
        steps.append((t0, time.perf_counter() - t0))
    if a.where == "thread":
        th.join()
    else:
        windows = json.loads(child.communicate()[0])
    first = windows[0][0] - GAP / 2
    inside = [d for t, d in steps if any(s <= t < e for s, e in windows)]
    outside = [d for t, d in steps if t >= first and not any(s - 0.05 <= t < e + 0.05 for s, e in windows)]
    print(f"{a.where}, switch {sys.getswitchinterval() * 1e3:g} ms: step {statistics.median(outside) * 1e3:.2f} ms, slowdown during save "
          f"{100 * (statistics.mean(inside) / statistics.mean(outside) - 1):.1f} %, "
          f"save {statistics.median(e - s for s, e in windows):.2f} s")


if __name__ == "__main__":
    main()
