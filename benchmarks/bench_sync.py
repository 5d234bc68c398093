"""Synchronous save and load: liferaft vs PyTorch DCP (and torch.save, safetensors), same state, same run.

What is measured (wall seconds of the call; 2-rank figures are the max over ranks):

- 1 process, no process group: save incl. fsync (DCP's FileSystemWriter fsyncs by default; torch.save and
  safetensors get an explicit fsync of the file and its folder), and load from disk: liferaft.load and DCP
  load in place into pre-allocated tensors, safetensors load_file + copy_ into them, torch.load (new tensors).
- 2 ranks (gloo on 127.0.0.1, CPU DeviceMesh): every rank holds DTensor Shard(0) shards of the same global
  state (0-dim step tensors are plain, replicated). Save with liferaft and DCP; load into the same layout;
  resharding load into Shard(1) (2-D) / Replicate (1-D); a 2→1 load in one process with no process
  group into full plain tensors; and a warm async save (after one untimed full-size async save in the same
  processes): liferaft.async_save (blocking staging) vs DCP async_save (thread executor, default stager),
  seconds until the call returns and until the checkpoint is durable.

State: GPT-like fp32 params + Adam exp_avg/exp_avg_sq + a 0-dim step per param (d=768, L=9 ≈ 1.07 GB for
``--size-gib 1``), a plain dict of tensors so every method gets the same bytes. Every load is checked
bit-exact against the reference and a wrong load aborts the benchmark.

Protocol ("cold", as in /work/shared/research/peer-baselines.md): every timed operation runs in a fresh
process, after a tiny untimed warm-up save/load with the same method and an idle of ``--idle`` seconds (on
the project VMs idle memory goes back to the host and first touch is ~1 GB/s); before each load every file of
the checkpoint is fsynced and dropped from the page cache with posix_fadvise(DONTNEED). Checkpoints are deleted
after each rep. Extra RSS is the peak RSS (sampled every 10 ms) above the RSS before the call, max over ranks.
Output: a markdown table on stdout, progress on stderr, one JSON line per measurement and per summary appended
to ``bench-out/bench_sync.jsonl``.
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
from _common import ROOT, append_jsonl, dir_bytes, drop_cache, machine, run_and_report, run_solo  # sets up the paths

from liferaft.testing import run_ranks

# (case, op, label) in table order
ROWS = [("1p", "save", "1 process: save (+fsync)"), ("1p", "load", "1 process: load from disk"),
        ("2r", "save", "2 ranks: save Shard(0)"), ("2r", "load_same", "2 ranks: load same layout"),
        ("2r", "load_reshard", "2 ranks: reshard load → Shard(1)/Replicate"),
        ("2r", "load_2to1", "2→1: load into full tensors, 1 process"),
        ("2r", "async_call", "2 ranks: async_save Shard(0), call returns (warm)"),
        ("2r", "async_save", "2 ranks: async_save Shard(0), until durable (warm)")]
COLUMNS = ["liferaft", "dcp", "bytecheckpoint", "torchsnapshot", "torch", "safetensors"]
COLUMN_TITLE = {"liferaft": "liferaft", "dcp": "DCP", "torch": "torch.save / torch.load",
                "safetensors": "safetensors", "bytecheckpoint": "ByteCheckpoint 0.0.2 (fast)",
                "torchsnapshot": "torchsnapshot 0.1.0"}
PEER_METHODS = {"bytecheckpoint", "torchsnapshot"}
TWO_RANKS = {"liferaft", "dcp", "bytecheckpoint"}      # torchsnapshot 0.1.0 cannot save DTensors
ASYNC = {"liferaft", "dcp"}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = W.pick_config(args.size_gib)
        self.nbytes = self.cfg.nbytes()
        self.tmp = os.path.join(ROOT, "bench-out", "tmp", f"sync-{os.getpid()}")
        self.jsonl = os.path.join(ROOT, "bench-out", "bench_sync.jsonl")
        self.run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        self.samples: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self.limits: list[dict[str, Any]] = []
        self.skipped: dict[str, str] = {}
        self.timeout = 300.0 + 120.0 * args.size_gib

    def record(self, case: str, op: str, method: str, rep: int, per_rank: list[dict[str, Any]],
               extra: dict[str, Any] | None = None) -> None:
        sec = max(r["seconds"] for r in per_rank)
        row = {"kind": "sample", "run": self.run_id, "case": case, "op": op, "method": method, "rep": rep,
               "seconds": sec, "per_rank_seconds": [r["seconds"] for r in per_rank], "bytes": self.nbytes,
               "gb_per_s": self.nbytes / sec / 1e9, "extra_rss": max(r["extra_rss"] for r in per_rank),
               "cpu_s": sum(r["cpu_s"] for r in per_rank) if all(r.get("cpu_s") is not None for r in per_rank) else None,
               "detail": [r["detail"] for r in per_rank], "io": [r.get("io", "") for r in per_rank], **(extra or {})}
        row["cpu_s_per_gb"] = row["cpu_s"] / (self.nbytes / 1e9) if row["cpu_s"] is not None else None
        self.samples.setdefault((case, op, method), []).append(row)
        self.write(row)
        cpu = f" {row['cpu_s_per_gb']:5.2f} CPU s/GB" if row["cpu_s_per_gb"] is not None else ""
        print(f"  rep {rep} {case:>2} {op:<12} {method:<11} {sec:8.3f} s {row['gb_per_s']:6.2f} GB/s{cpu} "
              f"+{row['extra_rss'] / 2**20:7.1f} MiB RSS", file=sys.stderr, flush=True)

    def write(self, row: dict[str, Any]) -> None:
        append_jsonl(self.jsonl, row)

    def solo(self, op: str, method: str, path: str) -> list[dict[str, Any]]:
        warm = os.path.join(self.tmp, f"warm-{method}")
        try:
            return [run_solo(W.solo_op, op, method, path, warm, self.cfg, self.args.idle)]
        finally:
            shutil.rmtree(warm, ignore_errors=True)

    def ranks(self, op: str, method: str, path: str, layout: str) -> list[dict[str, Any]]:
        warm = os.path.join(self.tmp, f"warm-{method}")
        try:
            return run_ranks(W.rank_op, 2, op, method, path, warm, self.cfg, self.args.idle, layout,
                             self.args.share_reads,
                             timeout=self.timeout, pg_timeout=self.timeout,
                             env={"PYTHONPATH": os.environ["PYTHONPATH"]})
        finally:
            shutil.rmtree(warm, ignore_errors=True)

    def one_process(self, rep: int, method: str) -> None:
        path = os.path.join(self.tmp, f"{method}-1p")
        os.makedirs(path)
        try:
            self.record("1p", "save", method, rep, self.solo("save", method, path), {"ckpt_bytes": dir_bytes(path)})
            drop_cache(path)
            self.record("1p", "load", method, rep, self.solo("load", method, path))
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def two_ranks(self, rep: int, method: str) -> None:
        path = os.path.join(self.tmp, f"{method}-2r")
        os.makedirs(path)
        try:
            self.record("2r", "save", method, rep, self.ranks("save", method, path, "shard0"),
                        {"ckpt_bytes": dir_bytes(path)})
            for op, layout in (("load_same", "shard0"), ("load_reshard", "shard1")):
                drop_cache(path)
                self.record("2r", op, method, rep, self.ranks("load", method, path, layout))
            drop_cache(path)
            self.record("2r", "load_2to1", method, rep, self.solo("load", method, path))
            shutil.rmtree(path, ignore_errors=True)
            if method not in ASYNC:
                return
            per_rank = self.ranks("async_save", method, path, "shard0")
            self.record("2r", "async_save", method, rep, per_rank)
            self.record("2r", "async_call", method, rep,
                        [{**r, "seconds": r["detail"]["call_s"], "cpu_s": None} for r in per_rank])
        finally:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(path + "-first", ignore_errors=True)

    def usable(self, method: str) -> bool:
        if method not in PEER_METHODS:
            return True
        import _peers

        why = _peers.available(method)
        if why:
            self.skipped[method] = why
            print(f"  skipping {method}: {why}", file=sys.stderr, flush=True)
        return why is None

    def run(self) -> None:
        os.makedirs(self.tmp, exist_ok=True)
        methods = [m for m in COLUMNS if m in self.args.methods and self.usable(m)]
        try:
            for rep in range(self.args.reps):
                order = methods[rep % len(methods):] + methods[:rep % len(methods)]   # rotate: spread drift
                out = run_solo(O.limits_op, os.path.join(self.tmp, "limits"), self.cfg, self.args.idle)
                self.limits.append(out)
                self.write({"kind": "limits", "run": self.run_id, "rep": rep, **out})
                print(f"  rep {rep} limits: write+fsync {out['write_fsync_s']:.3f} s, O_DIRECT write "
                      f"{out['direct_write_s']:.3f} s, read {out['read_s']:.3f} s; best write "
                      f"{O.best_write_s(out):.3f} s, best read {O.best_read_s(out):.3f} s", file=sys.stderr, flush=True)
                if "1p" in self.args.cases:
                    for m in order:
                        self.one_process(rep, m)
                if "2r" in self.args.cases:
                    for m in order:
                        if m in TWO_RANKS:
                            self.two_ranks(rep, m)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------ reporting

    def summary(self, key: tuple[str, str, str]) -> dict[str, Any] | None:
        rows = self.samples.get(key)
        if not rows:
            return None
        secs = [r["seconds"] for r in rows]
        med = statistics.median(secs)
        cpu = [r["cpu_s_per_gb"] for r in rows if r.get("cpu_s_per_gb") is not None]
        return {"kind": "summary", "run": self.run_id, "case": key[0], "op": key[1], "method": key[2],
                "reps": len(secs), "median_s": med, "min_s": min(secs), "max_s": max(secs),
                "gb_per_s": self.nbytes / med / 1e9, "cpu_s_per_gb": statistics.median(cpu) if cpu else None,
                "extra_rss_median": statistics.median(r["extra_rss"] for r in rows)}

    def header(self) -> str:
        cfg = self.cfg
        n = len(cfg.leaves())
        return (f"### Sync save/load, {datetime.date.today().isoformat()}: {machine()}\n\n"
                f"State: d={cfg.d}, L={cfg.layers}, {n} fp32 tensors, {self.nbytes / 1e9:.2f} GB. "
                f"{self.args.reps} reps, seconds median [min–max] and GB/s at the median; idle "
                f"{self.args.idle:g} s before each op; each op in a fresh process; loads after "
                f"fadvise(DONTNEED); 2-rank times are the max over ranks; every load verified bit-exact. "
                f"DCP/liferaft > 1 means liferaft is faster; limit/liferaft is the share of the physical limit "
                f"reached, against the best path the device offered in the same run (saves: the fastest durable write "
                f"of the limits table, O_DIRECT from 4 KiB or from 2 MiB pages or buffered, 1 or 4 requests in "
                f"flight; loads: the fastest cold read; a sync save copies the state through its 64 MiB ring, of "
                f"2 MiB pages where the kernel offers them, and writes from there; each op in a fresh process is "
                f"that process's first save, which also pays the ring's first touch), 1 = at the limit. CPU s/GB: CPU seconds (every thread, summed over ranks) per GB of "
                f"state, what the training job pays whatever the disk's hour. liferaft's 2-rank loads: "
                f"share_reads={self.args.share_reads}.\n")

    def table(self) -> str:
        cols = [m for m in COLUMNS if any(k[2] == m for k in self.samples)]
        titles = [COLUMN_TITLE[m] for m in cols]
        if "liferaft" in cols and "dcp" in cols:
            titles.insert(cols.index("dcp") + 1, "DCP/liferaft")
        if "liferaft" in cols and self.limits:
            titles.insert(1, "limit/liferaft")
        lines = ["| operation | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
        rss = ["", "Extra peak RSS, MiB (median):", "",
               "| operation | " + " | ".join(COLUMN_TITLE[m] for m in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for case, op, label in ROWS:
            sums = {m: self.summary((case, op, m)) for m in cols}
            if not any(sums.values()):
                continue
            cells, rcells = [], []
            for m in cols:
                s = sums[m]
                cpu = f" · {s['cpu_s_per_gb']:.2f} CPU s/GB" if s and s["cpu_s_per_gb"] is not None else ""
                cells.append(f"{s['median_s']:.2f} [{s['min_s']:.2f}–{s['max_s']:.2f}] · {s['gb_per_s']:.2f} GB/s{cpu}"
                             if s else "–")
                rcells.append(f"{s['extra_rss_median'] / 2**20:.0f}" if s else "–")
                if m == "liferaft" and self.limits:
                    best = {"save": O.best_write_s, "async_save": O.best_write_s, "async_call": None}.get(
                        op, O.best_read_s)
                    limit = statistics.median(best(r) for r in self.limits) if best else None
                    cells.append(f"{limit / s['median_s']:.2f}" if s and limit else "–")
                if m == "dcp" and "liferaft" in cols:
                    a, b = sums["liferaft"], sums["dcp"]
                    cells.append(f"**{b['median_s'] / a['median_s']:.2f}×**" if a and b else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            rss.append(f"| {label} | " + " | ".join(rcells) + " |")
        return "\n".join(lines + rss)

    def report(self) -> None:
        for key in self.samples:
            s = self.summary(key)
            if s:
                self.write(s)
        print(self.header())
        if self.limits:
            print(O.limits_table(self.limits, self.nbytes) + "\n")
        print(self.table())
        notes = [f"- {COLUMN_TITLE[m]}: not run ({why})" for m, why in self.skipped.items()]
        if any(k[2] == "torchsnapshot" for k in self.samples):
            notes.append("- torchsnapshot 0.1.0: no 2-rank rows, it cannot save DTensors (and a per-rank snapshot of "
                         "local shards restores into one process with silently wrong data; see benchmarks/_peers.py)")
        if notes:
            print("\n" + "\n".join(notes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1: d=768, L=9)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=4.0, help="seconds of idle before each timed op (default 4)")
    ap.add_argument("--cases", default="1p,2r", help="comma list of 1p (one process), 2r (two ranks)")
    ap.add_argument("--methods", default=",".join(COLUMNS), help="comma list of " + ", ".join(COLUMNS))
    ap.add_argument("--share-reads", choices=("default", "on", "off"), default="default",
                    help="liferaft's LoadOptions.share_reads for the 2-rank loads (default: the library's default)")
    args = ap.parse_args(argv)
    args.share_reads = {"default": None, "on": True, "off": False}[args.share_reads]
    args.cases = set(args.cases.split(","))
    args.methods = set(args.methods.split(","))
    if not args.methods <= set(COLUMNS) or not args.cases <= {"1p", "2r"}:
        ap.error("unknown case or method")
    return run_and_report(Bench(args))


if __name__ == "__main__":
    sys.exit(main())
