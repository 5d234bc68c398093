"""``liferaft ls`` and ``liferaft gc``: the steps under a CheckpointManager root (docs/cli/ls.md, docs/cli/gc.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import liferaft
from liferaft.cli.args import integer
from liferaft.cli.output import printable
from liferaft.cli.progress import Progress


def add_parsers(sub: Any) -> None:
    """Add ``ls`` and ``gc`` to the subcommands ``sub``."""
    p = sub.add_parser("ls", help="list the steps under a CheckpointManager root")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--verify", action="store_true", help="re-hash every committed step (reads all its data)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_ls)

    p = sub.add_parser("gc", help="delete steps the retention policy does not keep (never referenced ones)")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=integer(1))
    p.add_argument("--keep-every", type=integer(1))
    p.add_argument("--keep-best", type=integer(1))
    p.add_argument("--metric")
    p.add_argument("--mode", choices=["min", "max"], default="min")
    p.add_argument("--incomplete", action="store_true", help="also remove steps without a commit marker")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_gc)


def _age(created: float | None) -> str:
    if created is None:
        return "-"
    s = max(0.0, time.time() - created)
    return f"{s / 86400:.1f} d" if s >= 86400 else f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def _short(text: str, limit: int) -> str:
    """``text`` whole, or its start and end around '…' when longer than ``limit`` (job ids end in what tells
    two launches apart: a pid and start time, a uuid)."""
    return text if len(text) <= limit else text[:limit // 2 - 1] + "…" + text[-(limit - limit // 2):]


def run_ls(args: argparse.Namespace) -> int:
    """One line per step (or JSON): status, size, age, ranks, tiers, job, references or why it is not committed."""
    total = 0
    if args.verify and not args.json:
        for i in liferaft.ls(args.root):                  # what the re-hash will read, for the bar
            if i.status == "committed":
                try:
                    total += sum(t.nbytes for t in liferaft.inspect(i.path).tensors)
                except liferaft.LiferaftError:          # (listed as corrupt below, with the reason)
                    pass
    pins_error = None
    with Progress(total, "verify", None if args.verify and not args.json else False) as tick:
        try:                    # PINS is read first: a damaged one is listed unpinned, then reported (_ls_status)
            steps = liferaft.ls(args.root, verify=args.verify, progress=tick, check_pins=True)
        except liferaft.CorruptCheckpointError as e:
            pins_error = str(e)
            steps = liferaft.ls(args.root, verify=args.verify, progress=tick)
    args.pins_error = pins_error
    if args.json:
        print(json.dumps([{"step": i.step, "status": i.status, "reason": i.reason, "bytes": i.nbytes,
                           "created_unix": i.created_unix, "world_size": i.world_size, "job_id": i.job_id,
                           "tiers": list(i.tiers), "depends_on": list(i.depends_on), "pinned": i.pinned,
                           "metrics": dict(i.metrics)} for i in steps]))
        return _ls_status(args, steps)
    jobs = [_short(i.job_id or "-", 64) for i in steps]
    width = max([3] + [len(j) for j in jobs])
    print(f"{'step':>10}  {'status':<10} {'MiB':>9}  {'age':>8}  {'ranks':>5}  {'tiers':<6} {'job':<{width}} "
          "references / reason")
    for i, job in zip(steps, jobs):
        note = " ".join(i.reason.replace(i.path, "").split()).lstrip(": ") if i.status != "committed" else \
            (("refs " + ",".join(map(str, i.depends_on))) if i.depends_on else "") + (" pinned" if i.pinned else "")
        print(f"{i.step:>10}  {i.status:<10} {i.nbytes / 2**20:>9.1f}  {_age(i.created_unix):>8}  "
              f"{i.world_size or '-':>5}  {','.join(i.tiers) or '-':<6} {job:<{width}} {note}")
    return _ls_status(args, steps)


def _ls_status(args: argparse.Namespace, steps: list[liferaft.StepInfo]) -> int:
    """Exit status of ``ls``: 1 with ``--verify`` when any step is corrupt (each listed with its reason), and 1
    when the root's ``PINS`` is damaged (the steps listed, unpinned, then one line naming the file on stderr: gc
    and the manager refuse such a root)."""
    if getattr(args, "pins_error", None):
        print(f"liferaft ls: error: {args.pins_error}", file=sys.stderr)
        return 1
    return 1 if args.verify and any(i.status == "corrupt" for i in steps) else 0


def run_gc(args: argparse.Namespace) -> int:
    """Apply the retention policy of the arguments (or, with --dry-run, say what it would delete)."""
    r = liferaft.gc(args.root, keep_last=args.keep_last, keep_every=args.keep_every, keep_best=args.keep_best,
                    metric=args.metric, mode=args.mode, dry_run=args.dry_run, incomplete=args.incomplete,
                    on_wait=lambda m: print(f"liferaft gc: {printable(m)}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({"deleted": list(r.deleted), "kept": list(r.kept), "freed_bytes": r.freed_bytes,
                          "dry_run": r.dry_run}))
    else:
        verb = "would delete" if r.dry_run else "deleted"
        print(f"{verb} {len(r.deleted)} step(s) {list(r.deleted)}, {r.freed_bytes / 2**20:.1f} MiB; "
              f"kept {list(r.kept)}")
    return 0
