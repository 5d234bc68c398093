"""Every step recoverable, on a real loop: examples/train_gpt.py on 2 ranks (FSDP2 and DDP), step time and recovery.

For each layout, interleaved reps (A B C D A B C D) of the same model, data and step count:

- ``none``: no checkpoints (the baseline);
- ``per-step``: liferaft's per-step mode (``--per-step``: a gradient log in node memory with a peer replica on the
  other simulated node, full saves at the Young/Daly interval);
- ``liferaft``: liferaft's async saves at the Young/Daly interval (``--every auto``);
- ``dcp``: PyTorch DCP ``async_save`` at the Young/Daly interval (``--dcp-async auto``).

Step time: median and mean of the per-step wall times rank 0 records (``--timing``) after ``--warmup`` steps (the
default, 160, is past the per-step log's warm-up: until every slot of its ring has been used once, each record
takes fresh shared-memory pages, a one-time cost of about 1 GB/s on this VM that a 64-step window at step 32
counted as per-step overhead; since the ring-freeing full checkpoints start as late as their measured lag allows,
the ring uses ~58 of its 64 slots, and steps 100-163 still met a few fresh ones); the overhead is the mean's (it carries the save stalls) over the ``none`` mean of
the same rep. CPU: rank 0's process CPU seconds per step (every thread: on 2 shared cores the background work is
paid in step time as well), which varies far less with the machine's load than the wall time. ``--seq``/``--batch``
set the tokens per step: the per-step log's cost is per gradient byte, so its overhead falls as the compute per step grows. Recovery: a run is
killed with SIGKILL of rank 1 once rank 0 completed step ``--kill-at`` (rank 0 then killed too, as a launcher
tears a job down), restarted with the same root and job id; **recovery** = seconds from the restart to the first
completed step (process start, restore, replay, first step); **lost** = steps completed before the kill that the
restart trains again. Every rank is its own simulated node (``GROUP_RANK``), so the per-step records are replicated.

Prints the README's markdown table on stdout; with ``--costs F.json`` writes (or extends) a ``liferaft plan
--costs`` file with the per-step mode's measured overhead, step time, recovery and lost steps (docs/cli/plan.md).
Progress on stderr. ``--quick``: tiny model, few steps, one rep (a smoke run; figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import date
from typing import Any

from _common import ROOT, machine

SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
METHODS = {"none": ["--no-ckpt"], "per-step": ["--per-step", "--every", "auto"], "liferaft": ["--every", "auto"],
           "dcp": ["--dcp-async", "auto"]}
LABELS = {"none": "no checkpoints", "per-step": "liferaft per-step (memory log + peer replica)",
          "liferaft": "liferaft async saves, Young/Daly", "dcp": "DCP async_save, Young/Daly"}


def per_step_available() -> bool:
    import liferaft

    return hasattr(liferaft, "StepLogOptions")


class Job:
    """One launch of train_gpt.py on 2 ranks (plain processes with torchrun's environment variables)."""

    def __init__(self, args: argparse.Namespace, layout: str, method: str, root: str, job_id: str, steps: int,
                 timing: str) -> None:
        from liferaft.testing.launcher import free_port

        port, self.t0 = free_port(), time.time()
        self.what = f"{layout} {method}"
        cmd = [sys.executable, SCRIPT, "--root", root, "--layout", layout, "--steps", str(steps), "--dim",
               str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch),
               "--mtbf-hours", str(args.mtbf_hours), "--job-id", job_id,
               "--timing", timing, *METHODS[method]]
        self.procs = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                   "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                               text=True))

    def wait(self, timeout: float = 600) -> None:
        for r, p in enumerate(self.procs):
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise SystemExit(f"train_gpt.py rank {r} ({self.what}) failed ({p.returncode}):\n{err[-3000:]}")

    def kill(self) -> None:
        for p in self.procs:                      # rank 1 first: the failure; then the launcher's tear-down
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.communicate()


def records(timing: str) -> list[dict[str, Any]]:
    if not os.path.exists(timing):
        return []
    with open(timing) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def timed_run(args: argparse.Namespace, tmp: str, layout: str, method: str) -> dict[str, float]:
    root, timing = tempfile.mkdtemp(dir=tmp), os.path.join(tmp, f"t-{uuid.uuid4().hex}.jsonl")
    job_id = f"bench-{uuid.uuid4().hex[:12]}"
    try:
        Job(args, layout, method, root, job_id, args.warmup + args.steps + 1, timing).wait()
        recs = [r for r in records(timing) if args.warmup <= r.get("step", -1) < args.warmup + args.steps]
        times = [r["s"] for r in recs]
        return {"median": statistics.median(times), "mean": statistics.fmean(times),
                "cpu": statistics.fmean(r.get("cpu", float("nan")) for r in recs)}
    finally:
        cleanup(root, job_id)


def recovery_run(args: argparse.Namespace, tmp: str, layout: str, method: str) -> dict[str, float]:
    root, timing = tempfile.mkdtemp(dir=tmp), os.path.join(tmp, f"k-{uuid.uuid4().hex}.jsonl")
    job_id = f"bench-{uuid.uuid4().hex[:12]}"
    try:
        job = Job(args, layout, method, root, job_id, args.kill_at + 50, timing)
        deadline = time.time() + 600
        while not any(r.get("step", -1) >= args.kill_at for r in records(timing)):
            if time.time() > deadline or any(p.poll() is not None for p in job.procs):
                job.kill()
                raise SystemExit(f"{layout}/{method}: the run ended before step {args.kill_at}")
            time.sleep(0.005)
        job.kill()
        done = max(r["step"] for r in records(timing) if "step" in r)
        restart = os.path.join(tmp, f"r-{uuid.uuid4().hex}.jsonl")
        again = Job(args, layout, method, root, job_id, done + 3, restart)
        again.wait()
        rows = records(restart)
        resumed = rows[0]["resumed"]
        first = next(r for r in rows if "step" in r)
        next_step = 0 if resumed is None else resumed + 1
        return {"recovery_s": first["t"] - again.t0, "restore_s": rows[0]["restore_s"],
                "lost": done + 1 - next_step, "killed_after": done}
    finally:
        cleanup(root, job_id)


def cleanup(root: str, job_id: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(os.path.join("/dev/shm/liferaft", job_id), ignore_errors=True)   # MemoryTier's default base


def model_size(args: argparse.Namespace) -> tuple[int, int]:
    """(parameters, gradient bytes per rank under FSDP2 on 2 ranks)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from train_gpt import GPT

    n = sum(p.numel() for p in GPT(args.dim, args.layers, args.seq).parameters())
    return n, n * 4 // 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="fsdp,ddp")
    ap.add_argument("--methods", default="none,per-step,liferaft,dcp")
    ap.add_argument("--reps", type=int, default=2, help="timed reps per method (0: recovery only)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=160,
                    help="untimed steps first (default 160: past the per-step log's first round of fresh slots)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32, help="tokens per sample (train_gpt.py --seq)")
    ap.add_argument("--batch", type=int, default=12, help="global batch in samples (train_gpt.py --batch)")
    ap.add_argument("--mtbf-hours", type=float, default=1.0, help="the MTBF the Young/Daly intervals assume")
    ap.add_argument("--kill-at", type=int, default=20, help="kill -9 once this step is complete")
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument("--costs", metavar="F.json", help="write (or extend) a `liferaft plan --costs` file")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps, one rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup, args.dim, args.layers, args.kill_at = 1, 4, 2, 64, 2, 6
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r} (one of {', '.join(METHODS)})")
    skipped = {}
    if "per-step" in methods and not per_step_available():
        skipped["per-step"] = "n/a: this liferaft has no StepLogOptions"
        methods.remove("per-step")
    layouts = args.layouts.split(",")
    tmp = tempfile.mkdtemp(prefix="bench-steps-")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        for layout in layouts:
            for rep in range(args.reps):
                for m in methods if rep % 2 == 0 else reversed(methods):
                    t = timed_run(args, tmp, layout, m)
                    results.setdefault((layout, m), {"runs": []})["runs"].append(t)
                    print(f"{layout} {m} rep {rep}: median {t['median'] * 1e3:.1f} ms, mean {t['mean'] * 1e3:.1f} ms",
                          file=sys.stderr, flush=True)
            for m in methods if not args.no_recovery else ():
                if m != "none":
                    r = recovery_run(args, tmp, layout, m)
                    results.setdefault((layout, m), {"runs": []})["recovery"] = r
                    print(f"{layout} {m} recovery: {r}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(args, layouts, methods, skipped, results))
    if args.costs and "per-step" in methods and "none" in methods and args.reps > 0:
        write_costs(args.costs, layouts, results)
    return 0


def report(args: argparse.Namespace, layouts: list[str], methods: list[str], skipped: dict[str, str],
           results: dict[tuple[str, str], dict[str, Any]]) -> str:
    params, grad = model_size(args)
    lines = [f"Measured {date.today()} on {machine()}; examples/train_gpt.py --dim {args.dim} --layers "
             f"{args.layers} --seq {args.seq} --batch {args.batch} ({args.seq * args.batch // 2} tokens per rank per step, "
             f"{params / 1e6:.2f} M params, {grad / 2**20:.1f} MiB of fp32 gradients per rank "
             f"under FSDP2, {2 * grad / 2**20:.1f} MiB under DDP), 2 ranks (gloo), {args.steps} timed steps after "
             f"{args.warmup}, {args.reps} interleaved reps, MTBF {args.mtbf_hours:g} h for Young/Daly; kill -9 "
             f"after step {args.kill_at}. Targets: overhead ≤ 3 %, ≤ 1 step lost. CPU: rank 0's process CPU per step "
             "(all its threads; both ranks share 2 cores, so CPU spent in the background is step time too).", "",
             "| layout | method | step median (ms) | step mean (ms) | overhead (mean) | CPU per step (ms) | "
             "CPU overhead | recovery (s) | steps lost |",
             "|---|---|---|---|---|---|---|---|---|"]
    for layout in layouts:
        base = results.get((layout, "none"))
        for m in [*methods, *skipped]:
            if m in skipped:
                lines.append(f"| {layout} | {LABELS[m]} | {skipped[m]} | | | | | | |")
                continue
            runs = results.get((layout, m), {}).get("runs")
            med = f"{statistics.median(r['median'] for r in runs) * 1e3:.1f}" if runs else "–"
            mean = f"{statistics.median(r['mean'] for r in runs) * 1e3:.1f}" if runs else "–"
            over = "–" if m == "none" or not base or not base["runs"] or not runs else \
                f"{overhead(base['runs'], runs):+.1%}"
            cpu = f"{statistics.median(r['cpu'] for r in runs) * 1e3:.1f}" if runs else "–"
            cpu_over = "–" if m == "none" or not base or not base["runs"] or not runs else \
                f"{statistics.median(r['cpu'] / b['cpu'] - 1 for b, r in zip(base['runs'], runs)):+.1%}"
            rec = results.get((layout, m), {}).get("recovery")
            lines.append(f"| {layout} | {LABELS[m]} | {med} | {mean} | {over} | {cpu} | {cpu_over} | "
                         f"{'–' if rec is None else format(rec['recovery_s'], '.1f')} | "
                         f"{'–' if rec is None else rec['lost']} |")
    lines += ["", "How to reproduce: `python benchmarks/bench_steps.py` (add `--costs costs.json`, then "
              "`liferaft plan --costs costs.json`)."]
    return "\n".join(lines)


def overhead(base: list[dict[str, float]], runs: list[dict[str, float]]) -> float:
    """Median over reps of (this rep's mean step ÷ the baseline's mean step of the same rep) − 1."""
    return statistics.median(r["mean"] / b["mean"] - 1 for b, r in zip(base, runs))


def write_costs(path: str, layouts: list[str], results: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The per-step mode's worst layout's measured costs, added to ``path`` (read and checked as ``liferaft plan``
    reads it, or the defaults when it does not exist)."""
    from liferaft.cli.plan import DEFAULT_COSTS, load_costs

    costs = load_costs(path) if os.path.exists(path) else json.loads(json.dumps(DEFAULT_COSTS))
    worst = max(layouts, key=lambda lay: overhead(results[(lay, "none")]["runs"], results[(lay, "per-step")]["runs"]))
    rec = results[(worst, "per-step")].get("recovery")
    if rec is None:
        print(f"{path} not written: the per-step recovery was not measured (--no-recovery)", file=sys.stderr)
        return
    costs["per_step"] = {
        "overhead": max(0.0, overhead(results[(worst, "none")]["runs"], results[(worst, "per-step")]["runs"])),
        "step": statistics.median(r["mean"] for r in results[(worst, "none")]["runs"]),
        "restore": rec["recovery_s"], "lost_steps": max(0, rec["lost"])}
    if "machine" in costs:                     # (a machine file names what was measured rather than assumed)
        costs["measured"] = sorted(set(costs.get("measured", [])) | {"per_step"})
    with open(path, "w") as f:
        json.dump(costs, f, indent=1)
    print(f"wrote {path}: per_step {costs['per_step']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
