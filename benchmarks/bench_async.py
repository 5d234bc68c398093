"""Async save in a training loop: liferaft vs PyTorch DCP, against the physical limits, same state, same run.

What is measured (one process, no process group except DCP PROCESS, which needs one: a 1-rank gloo group):

- Physical limits on the same bytes: torch ``copy_`` of every tensor into already-touched tensors (1 and 2
  threads), Python write + fsync of every tensor's bytes to one file, O_DIRECT read of that file into a
  page-aligned anonymous mmap buffer (buffered read after fadvise(DONTNEED) if O_DIRECT is refused).
- Save methods: liferaft ``async_save`` (blocking staging, overlapped staging), ``liferaft.save``, DCP ``save``,
  DCP ``async_save`` THREAD (its default stager), THREAD + ``DefaultStager(StagingOptions(use_async_staging=
  True))`` (DCP's overlapped staging), PROCESS + ``DefaultStager(StagingOptions(use_shared_memory=True))``.
  DCP stagers passed by us are kept for the whole process (like liferaft's buffer pool). A DCP mode that fails
  is reported as n/a with its error.
- Each in a training loop (``_bench_async_ops``): steps of fixed CPU work (matmuls, ~``--step-ms`` at one
  thread) plus a small in-place "update" of the state; the save starts at step ``--save-at``, overlapped modes
  wait for their snapshot right before that step's update, and the loop runs ``--steps`` steps or longer, until
  the save is durable. **stall** = loop time − the same number of steps at the mean step time of a loop without
  a save run just before; **slowdown** = mean time of the later steps that started while the save was in
  flight ÷ the mean time of the steps of the same loop before the save and of the ``TAIL_STEPS`` (10) steps
  after it is durable − 1 (a base taken around the save in the same loop: this VM's step time drifts by up to
  20 % within a minute, so a loop run before would move the figure more than the save does); **CPU s/GB** = the process's CPU seconds (every thread; the PROCESS daemon included)
  over the loop with the save, less the same number of steps at the CPU per step of the loop without a save,
  per GB of state, and the **background** part of it: all but what the training thread spent in the save call
  and the wait for its snapshot; **call return** = the save call's own time; **total** = save call until durable
  (committed/fsynced); **extra RSS** = peak RSS (sampled every 10 ms) during the save above the RSS the process
  had before its first save (so memory a pool or stager keeps between saves counts; for PROCESS the daemon's
  whole peak RSS is shown apart, its shm staging counted in both). 1 thread
  (``torch.set_num_threads(1)``: the loop leaves a core to the save) and 2 threads (both cores).
- Protocol: per rep, the limits and each method in a fresh process; in it the first save (cold: pool/stager
  allocation, page faults; reported as "first save") and then the timed saves, each after an idle of
  ``--idle`` s (the project VMs return idle memory to the host). Every checkpoint is verified bit-exact in a
  separate process afterwards (liferaft.read / DCP load into empty tensors, minus the updates made before the
  snapshot); a wrong checkpoint aborts the run.

Output: markdown tables on stdout, progress on stderr, one JSON line per measurement and per summary appended
to ``bench-out/bench_async.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
from typing import Any

import _bench_async_ops as O
import _bench_ranks as W
from _common import (  # sets up the paths
    ROOT,
    append_jsonl,
    cpu_per_gb,
    fmt_cpu,
    machine,
    med_range,
    run_and_report,
    run_solo,
)

LABEL = {"liferaft-blocking": "liferaft async_save, blocking staging",
         "liferaft-overlapped": "liferaft async_save, overlapped staging",
         "liferaft-sync": "liferaft save (sync)",
         "liferaft-blocking-zstd": "liferaft async_save, blocking staging, compression on",
         "dcp-sync": "DCP save (sync)",
         "dcp-thread": "DCP async_save THREAD, default stager",
         "dcp-thread-async-staging": "DCP async_save THREAD + DefaultStager async staging",
         "dcp-process-shm": "DCP async_save PROCESS + shm DefaultStager"}
PEER = {"dcp-sync": "liferaft-sync", "dcp-thread": "liferaft-blocking",
        "dcp-thread-async-staging": "liferaft-overlapped", "dcp-process-shm": "liferaft-blocking"}
SYNC = {"liferaft-sync", "dcp-sync"}
LIMITS = O.LIMITS


def metrics(out: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """The numbers of one method's process that go into the tables (CPU: s/GB of the warm 1-thread save)."""
    w1, w2, cold = out["warm1"], out["warm2"], out["cold"]
    return {"cpu": cpu_per_gb(w1.get("save_cpu_s"), nbytes), "cpu_bg": cpu_per_gb(w1.get("bg_cpu_s"), nbytes),
            "stall1": w1["stall_s"], "stall2": w2["stall_s"], "call": w1["call_return_s"],
            "slow1": w1["slowdown_pct"], "slow2": w2["slowdown_pct"], "total": w1["durable_s"],
            "rss": w1["extra_rss"], "child_rss": w1["children_rss_peak"], "cold_stall": cold["stall_s"],
            "cold_total": cold["durable_s"]}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = W.pick_config(args.size_gib)
        self.nbytes = self.cfg.nbytes()
        self.tmp = os.path.join(ROOT, "bench-out", "tmp", f"async-{os.getpid()}")
        self.jsonl = os.path.join(ROOT, "bench-out", "bench_async.jsonl")
        self.run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.timeout = 120.0 + 120.0 * args.size_gib
        self.limits: list[dict[str, Any]] = []
        self.samples: dict[str, list[dict[str, Any]]] = {}
        self.skipped: dict[str, str] = {}
        self.k = 0

    def write(self, row: dict[str, Any]) -> None:
        append_jsonl(self.jsonl, {"run": self.run_id, "bytes": self.nbytes, **row})

    def run_limits(self, rep: int) -> None:
        out = run_solo(O.limits_op, os.path.join(self.tmp, "limits"), self.cfg, self.args.idle)
        self.limits.append(out)
        self.write({"kind": "limits", "rep": rep, **out})
        print(f"  rep {rep} limits: " + ", ".join(f"{k} {out[k]:.3f} s" for k, _ in LIMITS) + f" ({out['read_mode']})",
              file=sys.stderr, flush=True)

    def run_method(self, rep: int, method: str) -> None:
        a = self.args
        out = run_solo(O.method_op, method, self.tmp, self.cfg, a.steps, a.step_ms, a.matmul, a.save_at, a.idle,
                       self.timeout)
        if "error" in out:
            self.skipped[method] = out["error"]
            self.write({"kind": "skip", "rep": rep, **out})
            print(f"  rep {rep} {method:<25} n/a: {out['error']}", file=sys.stderr, flush=True)
            return
        run_solo(O.verify_op, method, out["checkpoints"], self.cfg)
        self.k = out["matmuls_per_step"]
        m = metrics(out, self.nbytes)
        self.samples.setdefault(method, []).append({**out, "metrics": m})
        self.write({"kind": "sample", "rep": rep, "verified": True, **out, "metrics": m})
        slow = "/".join("–" if m[k] is None else f"{m[k]:+.0f}%" for k in ("slow1", "slow2"))
        print(f"  rep {rep} {method:<25} stall {m['stall1']:6.3f}/{m['stall2']:6.3f} s  call {m['call']:6.3f} s  "
              f"slowdown {slow}  total {m['total']:6.2f} s  {m['cpu']:5.2f} CPU s/GB ({m['cpu_bg']:5.2f} in the "
              f"background)  +{m['rss'] / 2**20:6.0f} MiB  "
              f"first-save stall {m['cold_stall']:6.3f} s  (verified)", file=sys.stderr, flush=True)

    def run(self) -> None:
        os.makedirs(self.tmp, exist_ok=True)
        methods = [m for m in O.METHODS if m in self.args.methods]
        try:
            for rep in range(self.args.reps):
                self.run_limits(rep)
                order = methods[rep % len(methods):] + methods[:rep % len(methods)]   # rotate: spread drift
                for m in order:
                    self.run_method(rep, m)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------ reporting

    def values(self, method: str, key: str) -> list[float]:
        return [s["metrics"][key] for s in self.samples.get(method, []) if s["metrics"][key] is not None]

    def med(self, method: str, key: str) -> float | None:
        v = self.values(method, key)
        return statistics.median(v) if v else None

    def cell(self, method: str, key: str, fmt: str = ".3f") -> str:
        v = self.values(method, key)
        return med_range(v, fmt) if v else "–"

    def header(self) -> str:
        a, cfg = self.args, self.cfg
        base = [s["warm1"]["base_step_s"] for ss in self.samples.values() for s in ss]
        step = f"{1e3 * statistics.median(base):.0f} ms" if base else "?"
        return (f"### Async save in a training loop, {datetime.date.today().isoformat()}: {machine()}\n\n"
                f"State: d={cfg.d}, L={cfg.layers}, {len(cfg.leaves())} fp32 tensors, {self.nbytes / 1e9:.2f} GB. "
                f"{a.reps} reps, median [min–max]; idle {a.idle:g} s before each timed op; each method in a fresh "
                f"process, timed after one untimed first save; loop: {a.steps}+ steps of {self.k} matmul(s) "
                f"{a.matmul}² (~{step} per step at 1 thread), save started at step {a.save_at}; every checkpoint "
                f"verified bit-exact. DCP/liferaft > 1 means liferaft is better.\n")

    def limits_table(self) -> str:
        return O.limits_table(self.limits, self.nbytes)

    def main_table(self) -> str:
        lines = ["| method | stall in loop, 1 thread (s) | stall, 2 threads (s) | call return (s) | slowdown during "
                 "save, 1 / 2 threads | total until durable (s) | CPU s/GB, 1 thread: whole save | of it in the "
                 "background | extra RSS (MiB) | first save in process: stall (s) |",
                 "|---" * 10 + "|"]
        for m in O.METHODS:
            if m in self.skipped and m not in self.samples:
                lines.append(f"| {LABEL[m]} | n/a: {self.skipped[m]} |" + " |" * 8)
                continue
            if m not in self.samples:
                continue
            slow = "–" if m in SYNC else " / ".join("–" if self.med(m, k) is None else f"{self.med(m, k):+.0f}%"
                                                   for k in ("slow1", "slow2"))
            rss = f"{self.med(m, 'rss') / 2**20:.0f}"
            child = self.med(m, "child_rss")
            if child:
                rss += f" (daemon process: {child / 2**20:.0f} in all)"
            lines.append(f"| {LABEL[m]} | {self.cell(m, 'stall1')} | {self.cell(m, 'stall2')} | {self.cell(m, 'call')} "
                         f"| {slow} | {self.cell(m, 'total', '.2f')} | {fmt_cpu(self.values(m, 'cpu'))} "
                         f"| {fmt_cpu(self.values(m, 'cpu_bg'))} | {rss} | {self.cell(m, 'cold_stall')} |")
        return "\n".join(lines)

    def ratio_table(self) -> str:
        memcpy = statistics.median(r["memcpy_1t_s"] for r in self.limits)
        wf = statistics.median(r["write_fsync_s"] for r in self.limits)
        dw = statistics.median(r["direct_write_s"] for r in self.limits)
        lines = ["Ratios (medians): stall ÷ prefaulted memcpy (1 thread), total ÷ write + fsync and ÷ O_DIRECT "
                 "write; DCP/liferaft against the liferaft mode named.", "",
                 "| method | stall ÷ memcpy | call ÷ memcpy | total ÷ write+fsync | total ÷ O_DIRECT write "
                 "| DCP/liferaft: stall 1 thread | stall 2 threads | total | first-save stall |", "|---" * 9 + "|"]

        def ratio(m: str, peer: str, key: str) -> str:
            a, b = self.med(peer, key), self.med(m, key)
            return f"**{b / a:.2f}×**" if a and b is not None and a > 0 else "–"

        for m in O.METHODS:
            if m not in self.samples:
                continue
            s1, call, tot = self.med(m, "stall1"), self.med(m, "call"), self.med(m, "total")
            cells = [f"{v / lim:.2f}" if v is not None else "–"
                     for v, lim in ((s1, memcpy), (call, memcpy), (tot, wf), (tot, dw))]
            peer = PEER.get(m)
            if peer and peer in self.samples:
                cells += [f"{ratio(m, peer, k)}" for k in ("stall1", "stall2", "total", "cold_stall")]
                cells[-4] += f" (vs {peer})"
            else:
                cells += ["–"] * 4
            lines.append(f"| {LABEL[m]} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def report(self) -> None:
        for m in self.samples:
            self.write({"kind": "summary", "method": m, "reps": len(self.samples[m]),
                        **{k: {"median": self.med(m, k), "min": min(self.values(m, k), default=None),
                               "max": max(self.values(m, k), default=None)} for k in self.samples[m][0]["metrics"]}})
        if self.limits:
            self.write({"kind": "limits_summary",
                        **{k: statistics.median(r[k] for r in self.limits) for k, _ in LIMITS}})
        print(self.header())
        print(self.limits_table() + "\n")
        print(self.main_table() + "\n")
        if self.limits and self.samples:
            print(self.ratio_table())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1: d=768, L=9)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=4.0, help="seconds of idle before each timed op (default 4)")
    ap.add_argument("--steps", type=int, default=30, help="loop steps (at least; default 30)")
    ap.add_argument("--step-ms", type=float, default=50.0, help="CPU work per step at 1 thread (default 50 ms)")
    ap.add_argument("--matmul", type=int, default=1024, help="matmul size of the step's work (default 1024)")
    ap.add_argument("--save-at", type=int, default=3, help="step at which the save starts (default 3)")
    ap.add_argument("--methods", default=",".join(O.METHODS), help="comma list of " + ", ".join(O.METHODS))
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 64 MiB, 1 rep, 12 steps of ~25 ms, idle 0")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.reps, args.steps, args.step_ms, args.idle = 1 / 16, 1, 12, 25.0, 0.0
    args.methods = set(args.methods.split(","))
    if not args.methods <= set(O.METHODS) or args.save_at >= args.steps:
        ap.error("unknown method, or --save-at not below --steps")
    return run_and_report(Bench(args))


if __name__ == "__main__":
    sys.exit(main())
