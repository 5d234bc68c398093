"""An elastic restart under torchrun, timed from the kill to the first step after it, split into parts.

examples/train_gpt.py runs under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` (gloo, CPU); once
rank 0 has logged step ``--kill-after``, one worker (``--victim``, the rank) is killed with SIGKILL. torchrun sees
it die, stops the survivor, starts both workers again (TORCHELASTIC_RESTART_COUNT=1), and the manager restores:

- ``per-step``: the per-step log and a memory tier (``--per-step``: the node's shared memory, a peer replica; full
  saves every ``--every`` steps): the restore takes the newest full save from memory and replays the log's records
  after it, so the job resumes at the step after the last one completed;
- ``memory``: full saves to the memory tier every ``--every`` steps (and the root): resumes at the newest;
- ``disk``: full saves to the root (local disk) only, every ``--every`` steps;
- ``dcp``: the comparison, PyTorch DCP ``async_save`` every ``--every`` steps to local disk (train_gpt.py's
  ``--dcp-async``) and ``dcp.load`` of the newest on restart.

Parts, from rank 0's marks (examples/train_gpt.py ``--timing``) and the kill's time: **torchrun** (the kill until
the new rank 0 process started: torchrun noticing the death, stopping the survivor, the rendezvous of the new round,
the spawn), **launch** (start to torch and liferaft imported), **process group** (``init_process_group``), **build**
(model, optimizer, data), **manager** (``CheckpointManager(...)``), **restore** (``mgr.restore``: listing, loading,
replay), **first step** (the first training step and its ``maybe_save``). Also: steps lost (the last step completed
before the kill, minus the step resumed at). ``--reps`` runs per method, medians.

    python benchmarks/bench_elastic.py [--methods per-step,memory,disk,dcp] [--reps 3] [--kill-after 120]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid

import psutil
from _common import ROOT, machine  # sets up the paths

from liferaft.tiers.memory import DEFAULT_BASE

PARTS = ("torchrun", "launch", "process group", "build", "manager", "restore", "first step")
METHODS = {"per-step": ["--per-step"], "memory": ["--memory"], "disk": [], "dcp": ["--dcp-async"]}


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _victim(agent: psutil.Process, rank: int) -> psutil.Process | None:
    for child in agent.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train_gpt.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def run_once(method: str, args: argparse.Namespace, tmp: str) -> dict:
    """One job: train, kill a worker after ``kill_after`` steps, restart, finish; the parts of the restart."""
    root = os.path.join(tmp, "root")
    timing = os.path.join(tmp, "timing.jsonl")
    log = os.path.join(tmp, "job.log")
    job = f"bench-elastic-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "--monitor-interval", str(args.monitor_interval), os.path.join(ROOT, "examples", "train_gpt.py"),
           "--root", root, "--steps", str(args.steps), "--every", str(args.every), "--layout", args.layout,
           "--timing", timing, "--job-id", job, *METHODS[method]] + ([str(args.every)] if method == "dcp" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "src"))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        agent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 600
        while not any(r.get("step", -1) >= args.kill_after for r in _lines(timing)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{method}: the job ended or stalled before step {args.kill_after}:\n"
                                 + open(log).read()[-3000:])
            time.sleep(0.02)
        victim = _victim(agent, args.victim)
        if victim is None:
            raise SystemExit(f"{method}: no worker of rank {args.victim} found")
        done_before = max(r["step"] for r in _lines(timing) if "step" in r)
        killed = time.time()
        victim.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.join(DEFAULT_BASE, job), ignore_errors=True)     # the memory tier's shared memory
    if rc != 0:
        raise SystemExit(f"{method}: torchrun ended with {rc}:\n" + open(log).read()[-3000:])
    rows = _lines(timing)
    again = [i for i, r in enumerate(rows) if r.get("restart") == 1]
    if not again:
        raise SystemExit(f"{method}: no restarted incarnation in {timing}:\n" + open(log).read()[-3000:])
    i = again[0]
    head, m = rows[i], rows[i]["marks"]
    first = next(r for r in rows[i + 1:] if "step" in r)
    done_before = max([done_before] + [r["step"] for r in rows[:i] if "step" in r])
    parts = {"torchrun": m["started"] - killed, "launch": m["imported"] - m["started"],
             "process group": m["process_group"] - m["imported"], "build": m["built"] - m["process_group"],
             "manager": m["manager"] - m["built"], "restore": m["restored"] - m["manager"],
             "first step": first["t"] - m["restored"]}
    resumed = head["resumed"]
    return {"parts": parts, "total": first["t"] - killed, "lost": done_before - (resumed if resumed is not None else -1),
            "resumed": resumed, "last_before": done_before, "replayed": head.get("replayed"),
            "recovery": head.get("recovery")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="per-step,memory,disk,dcp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=120, help="kill once rank 0 logged this step")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--every", type=int, default=50, help="full saves every N steps")
    ap.add_argument("--layout", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--victim", type=int, default=1, help="the rank killed")
    ap.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun's (seconds)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(args.reps):
        for method in methods:                       # interleaved: the VM's hour affects every method alike
            tmp = os.path.join(ROOT, "bench-out", "tmp", f"elastic-{uuid.uuid4().hex[:8]}")
            os.makedirs(tmp)
            try:
                r = run_once(method, args, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            results[method].append(r)
            print(f"rep {rep} {method}: {r['total']:.2f} s, resumed at {r['resumed']} (last before the kill "
                  f"{r['last_before']}), " + ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items())
                  + (f"; recovery {r['recovery']}" if r["recovery"] else ""), file=sys.stderr, flush=True)
    print(f"### Elastic restart under torchrun, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"examples/train_gpt.py, {args.layout}, 2 ranks (gloo), `torchrun --standalone --max-restarts 1 "
          f"--monitor-interval {args.monitor_interval}`; rank {args.victim} killed (SIGKILL) after step "
          f"{args.kill_after}; full saves every {args.every} steps; median of {args.reps} runs, seconds:\n")
    print("| method | kill → first step after it | " + " | ".join(PARTS) + " | steps lost |")
    print("|---|---|" + "---|" * len(PARTS) + "---|")
    for method, rs in results.items():
        med = {p: statistics.median(r["parts"][p] for r in rs) for p in PARTS}
        print(f"| {method} | {statistics.median(r['total'] for r in rs):.2f} | "
              + " | ".join(f"{med[p]:.2f}" for p in PARTS)
              + f" | {statistics.median(r['lost'] for r in rs):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
