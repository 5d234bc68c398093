"""``liferaft plan``: the goodput model at scale (docs/cli/plan.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

from liferaft.cli.args import integer, integers, number
from liferaft.errors import CorruptCheckpointError, OptionsError
from liferaft.format import jsonsafe
from liferaft.manager.goodput import GIB, Cluster, Costs, Machine, compare, costs_at

#: Largest ``--costs`` file read (bytes), and how deep its JSON may nest.
MAX_COSTS_BYTES = 1 << 20
MAX_COSTS_DEPTH = 8
#: Largest GPU count ``--gpus`` takes.
MAX_GPUS = 10_000_000
#: The fields ``--costs`` must give (tier → seconds); ``persist`` (tier → seconds) and ``restart`` are optional.
REQUIRED_COSTS = {"stall": ("memory", "remote"), "restore": ("memory", "peer", "remote")}
#: The optional ``per_step`` object (the per-step log, measured by benchmarks/bench_steps.py): field → (low, high)
PER_STEP_FIELDS = {"overhead": (0.0, 1.0), "step": (1e-6, 1e6), "restore": (0.0, 1e9), "lost_steps": (0.0, 1e6)}

#: The ``machine`` section of a ``--costs`` file: ``liferaft.manager.goodput.Machine``'s fields → (low, high). Bytes
#: and bytes/s must be positive; seconds from 0; the interference a share.
MACHINE_FIELDS: Mapping[str, tuple[float, float]] = {
    "state_bytes_per_gpu": (1.0, 1e15), "snapshot_bps": (1e3, 1e15), "replica_bps": (1e3, 1e15),
    "memory_restore_bps": (1e3, 1e15), "peer_restore_bps": (1e3, 1e15), "remote_write_bps": (1e3, 1e18),
    "remote_read_bps": (1e3, 1e18), "remote_client_bps": (1e3, 1e15), "detect_s": (0.0, 1e6),
    "reschedule_s": (0.0, 1e6), "launch_s": (0.0, 1e6), "rendezvous_s": (0.0, 1e6),
    "rendezvous_per_node_s": (0.0, 1e3), "process_groups_s": (0.0, 1e6), "process_groups_per_gpu_s": (0.0, 1e3),
    "first_step_s": (0.0, 1e6), "interference": (0.0, 1.0)}

#: Default costs: a ``machine`` section of ``Machine``'s defaults (1 GiB of state per GPU; the sources of each
#: figure are in docs/cli/plan.md), whose stall, persist, restore and restart are derived at each job size.
#: A costs file may instead give fixed seconds (``stall``, ``restore``, ``persist``, ``restart``: the format of
#: these files before the machine section existed, still read).
DEFAULT_COSTS: Mapping[str, Any] = {
    "machine": {},
    # the per-step log as measured here (README, bench_steps: DDP on 2 ranks, +4.4 % step time, recovery and
    # replay 1.72 s, no step lost)
    "per_step": {"overhead": 0.044, "step": 0.306, "restore": 1.72, "lost_steps": 0}}
#: Most failures a ``--simulate`` run draws (over all its horizons), so that a huge job cannot keep it busy for hours.
MAX_SIMULATED_FAILURES = 1_000_000
#: Most ``--horizons``.
MAX_HORIZONS = 1000


def add_parsers(sub: Any) -> None:
    """Add ``plan`` to the subcommands ``sub``."""
    p = sub.add_parser("plan", help="goodput simulator: expected useful share of training time at 1k/16k/100k GPUs")
    p.add_argument("--costs", metavar="F.json", help="measured costs: {\"machine\": {field: number}} (per-GPU bytes, "
                   "bandwidths, restart parts: docs/cli/plan.md; benchmarks/bench_goodput_costs.py writes one) or "
                   "fixed seconds {\"stall\": {\"memory\": s, \"remote\": s}, \"persist\": {...}, \"restore\": "
                   "{\"memory\": s, \"peer\": s, \"remote\": s}, \"restart\": s}; either with an optional "
                   "\"per_step\": {\"overhead\": share, \"step\": s, \"restore\": s, \"lost_steps\": n}")
    p.add_argument("--gpus", type=integers(1, MAX_GPUS), default=[1000, 16000, 100000],
                   help="comma list of GPU counts")
    p.add_argument("--failures-per-gpu-hour", type=number(1e-12, 1.0), default=Cluster.failures_per_gpu_hour)
    p.add_argument("--node-share", type=number(0, 1), default=Cluster.node_share,
                   help="share of failures that take a node (its memory) down")
    p.add_argument("--multi-node-share", type=number(0, 1), default=Cluster.multi_node_share,
                   help="share of failures that take several nodes (and maybe both copies of a replica) down")
    p.add_argument("--storage-share", type=number(0, 1), default=Cluster.storage_share,
                   help="share of failures of the shared store (the job stops; the remote tier is down a while)")
    p.add_argument("--storage-outage-min", type=number(0, 1e6), default=Cluster.storage_outage_s / 60,
                   help="minutes the shared store stays down after a storage failure")
    p.add_argument("--state-gib", type=number(1e-6, MACHINE_FIELDS["state_bytes_per_gpu"][1] / GIB, above=True),
                   metavar="GIB",
                   help="GiB of state each GPU saves (a machine costs file, or the defaults)")
    p.add_argument("--remote-gbps", type=number(1e-3, 1e9, above=True), metavar="GB/S",
                   help="aggregate bandwidth of the remote store for this job, GB/s, read and write")
    p.add_argument("--simulate", action="store_true",
                   help="also simulate months of the job failure by failure (Monte Carlo): goodput with a 95%% "
                        "interval, and where the time went")
    p.add_argument("--days", type=number(1e-3, 3650), default=30.0, help="length of one simulated run (days)")
    p.add_argument("--horizons", type=integer(2, MAX_HORIZONS), default=8,
                   help="simulated runs per plan (independent)")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plans' goodput at each GPU count (a table, or JSON); with ``--simulate`` the simulation beside."""
    from liferaft.manager.goodsim import simulate

    raw = load_costs(args.costs) if args.costs else DEFAULT_COSTS
    base = _inputs(raw, args)
    share = args.node_share + args.multi_node_share + args.storage_share
    if share > 1 + 1e-9:
        raise OptionsError(f"--node-share + --multi-node-share + --storage-share is {share:g}, more than 1 (the "
                           "job class takes the rest)")
    mix = {"failures_per_gpu_hour": args.failures_per_gpu_hour, "node_share": args.node_share,
           "multi_node_share": args.multi_node_share, "storage_share": args.storage_share,
           "storage_outage_s": args.storage_outage_min * 60}
    if args.simulate:                    # every plan of every count simulates its horizons' failures
        worst = sum(args.gpus) * args.failures_per_gpu_hour / 3600 * args.days * 86400 * args.horizons * 4
        if worst > MAX_SIMULATED_FAILURES:
            raise OptionsError(f"--simulate would draw about {worst:.3g} failures (more than "
                               f"{MAX_SIMULATED_FAILURES:,}): give fewer --days, --horizons or --gpus")
    rows = []
    for n in args.gpus:
        cluster = Cluster(gpus=n, **mix)
        costs = costs_at(base, cluster, raw.get("per_step")) if isinstance(base, Machine) else base
        for plan in compare(costs, cluster):
            sim = simulate(costs, cluster, plan.intervals, horizon_s=args.days * 86400, horizons=args.horizons,
                           seed=args.seed) if args.simulate else None
            rows.append((cluster, costs, plan, sim))
    if args.json:
        print(json.dumps([_json(c, k, p, s) for c, k, p, s in rows]))
        return 0
    print(_describe(raw, base, args, mix))
    print(_table(rows))
    if args.simulate:
        print()
        print(_where(rows, args))
    return 0


def _inputs(raw: Mapping[str, Any], args: argparse.Namespace) -> Costs | Machine:
    """The ``Machine`` of a machine costs file (with ``--state-gib`` and ``--remote-gbps``), or the fixed
    ``Costs`` of a seconds file (which takes neither)."""
    if "machine" in raw:
        fields = dict(raw["machine"])
        if args.state_gib is not None:
            fields["state_bytes_per_gpu"] = args.state_gib * GIB
        if args.remote_gbps is not None:
            fields["remote_write_bps"] = fields["remote_read_bps"] = args.remote_gbps * 1e9
        return Machine(**{k: float(v) for k, v in fields.items()})
    if args.state_gib is not None or args.remote_gbps is not None:
        raise OptionsError(f"--costs {args.costs}: gives fixed seconds (stall, restore, ...), which --state-gib and "
                           "--remote-gbps cannot scale; give a file with a \"machine\" section or neither option")
    return Costs(stall=raw["stall"], restore=raw["restore"], restart=float(raw.get("restart", 120.0)),
                 persist=raw.get("persist", {}), per_step=raw.get("per_step"))


def _describe(raw: Mapping[str, Any], base: Costs | Machine, args: argparse.Namespace, mix: Mapping[str, float]) -> str:
    src = f"--costs {args.costs}" if args.costs else "defaults"
    shares = Cluster(gpus=1, **mix).shares
    head = (f"failures: {mix['failures_per_gpu_hour']:.3g} per GPU-hour; shares " +
            ", ".join(f"{c} {s:.1%}" for c, s in shares.items()) +
            f"; a storage failure keeps the store down {mix['storage_outage_s'] / 60:g} min")
    if isinstance(base, Machine):
        m = base
        text = (f"inputs ({src}): {m.state_bytes_per_gpu / GIB:g} GiB per GPU; snapshot {m.snapshot_bps / 1e9:g} GB/s "
                f"per GPU, replica {m.replica_bps / 1e9:g} GB/s per node, remote {m.remote_write_bps / 1e9:g} / "
                f"{m.remote_read_bps / 1e9:g} GB/s in all (write / read), {m.remote_client_bps / 1e9:g} GB/s per node; "
                f"restart: detect {m.detect_s:g} s, reschedule {m.reschedule_s:g} s (a node lost), launch "
                f"{m.launch_s:g} s, rendezvous {m.rendezvous_s:g} s + {m.rendezvous_per_node_s * 1e3:g} ms per node, "
                f"process groups {m.process_groups_s:g} s + {m.process_groups_per_gpu_s * 1e3:g} ms per GPU, first "
                f"step {m.first_step_s:g} s; interference {m.interference:.1%}")
    else:
        c = base
        text = (f"costs (s): stall {dict(c.stall)}, persist {dict(c.persist)}, restore {dict(c.restore)}, "
                f"restart {c.restart:.0f}")
    if raw.get("per_step") is not None:
        text += f", per_step {dict(raw['per_step'])}"
    if raw.get("measured"):
        text += f"\nmeasured on this machine: {', '.join(map(str, raw['measured']))}"
    return text + "\n" + head


def _table(rows: list[Any]) -> str:
    sim = rows and rows[0][3] is not None
    lines = ["| GPUs | MTBF of the job | plan | intervals | restart (job / node) | restore (memory / peer / remote) | "
             "goodput" + (" | simulated (95 % interval)" if sim else "") + " |",
             "|---|---|---|---|---|---|---" + ("|---" if sim else "") + "|"]
    for cluster, costs, plan, s in rows:
        iv = ", ".join(f"{t} {_fmt(v)}" for t, v in plan.intervals.items())
        restart = " / ".join(_fmt(sum(costs.restart_of(c).values())) for c in ("job", "node"))
        restore = " / ".join(_fmt(costs.restore[p]) for p in ("memory", "peer", "remote"))
        lines.append(f"| {cluster.gpus:,} | {_fmt(1 / cluster.rate_per_s)} | {plan.name} | {iv} | {restart} | "
                     f"{restore} | {plan.goodput:.1%}" + (f" | {s.goodput:.1%} ± {s.ci95:.1%}" if s else "") + " |")
    return "\n".join(lines)


#: The buckets of the simulation, in the order the table shows them.
BUCKETS = ("useful", "save stalls", "save interference", "lost work", "detect", "reschedule", "launch", "rendezvous",
           "process_groups", "first_step", "restart", "restore", "storage wait", "interrupted")


def _where(rows: list[Any], args: argparse.Namespace) -> str:
    shown = [b for b in BUCKETS if any(s.seconds.get(b, 0) for *_, s in rows)]
    lines = [(f"Where the time went (simulated: {args.horizons} runs of {args.days:g} days each, seed {args.seed}; "
              "% of wall time):"), "",
             "| GPUs | plan | failures per run | " + " | ".join(shown) + " |",
             "|---|---|---|" + "---|" * len(shown)]
    for cluster, _, plan, s in rows:
        total = sum(s.seconds.values()) or 1.0
        lines.append(f"| {cluster.gpus:,} | {plan.name} | {sum(s.failures.values()):.0f} | "
                     + " | ".join(f"{100 * s.seconds.get(b, 0) / total:.2f}" for b in shown) + " |")
    return "\n".join(lines)


def _json(cluster: Cluster, costs: Costs, plan: Any, sim: Any) -> dict[str, Any]:
    out = {"gpus": cluster.gpus, "plan": plan.name, "intervals_s": dict(plan.intervals), "goodput": plan.goodput,
           "recovery": dict(plan.recovery), "restart_s": {c: dict(costs.restart_of(c)) for c in cluster.shares},
           "restore_s": dict(costs.restore), "persist_s": dict(costs.persist), "stall_s": dict(costs.stall)}
    if sim is not None:
        out["simulated"] = {"goodput": sim.goodput, "ci95": sim.ci95, "seconds": dict(sim.seconds),
                            "failures": dict(sim.failures), "runs": sim.horizons}
    return out


def _fmt(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1e3:.0f} ms"


def load_costs(path: str) -> dict[str, Any]:
    """The costs of ``--costs`` checked whole: a regular JSON file of at most ``MAX_COSTS_BYTES``, an object with
    ``stall`` and ``restore`` (objects of the ``REQUIRED_COSTS`` tiers), optional ``persist`` (tier → seconds) and
    ``restart``, every time a number (int or float, not bool) from 0 to 1e9, optional ``per_step`` (see
    ``_per_step``). The JSON is read by the strict reader (format/jsonsafe.py: one object, no key twice, no NaN or
    overflowing float, nesting ≤ ``MAX_COSTS_DEPTH``). OptionsError naming the file and the field otherwise."""
    where = f"--costs {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise OptionsError(f"{where}: cannot open it: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):                   # (before fdopen: it refuses a folder with a bare errno)
        os.close(fd)
        raise OptionsError(f"{where}: not a regular file" + (" (a folder)" if stat.S_ISDIR(st.st_mode) else ""))
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_COSTS_BYTES:
            raise OptionsError(f"{where}: {st.st_size} bytes, more than a costs file holds ({MAX_COSTS_BYTES})")
        data = f.read(MAX_COSTS_BYTES + 1)
    try:                                  # the strict reader: no duplicate keys, NaN, overflowing numbers, deep nesting
        raw = jsonsafe.loads(data, where, MAX_COSTS_BYTES, MAX_COSTS_DEPTH,
                             advice="fix the file (fields and units: liferaft plan --help)")
    except CorruptCheckpointError as e:
        raise OptionsError(str(e)) from None
    if not isinstance(raw, dict):
        raise OptionsError(f"{where}: expected a JSON object with a machine section (or stall, restore, persist "
                           f"and restart), got {type(raw).__name__}")
    if "machine" in raw:
        return _machine_file(where, raw)
    unknown = sorted(set(raw) - {"stall", "restore", "persist", "restart", "per_step"})
    if unknown:
        raise OptionsError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} (stall, restore, persist, "
                           "restart, per_step)"[:400])
    for name, tiers in (*REQUIRED_COSTS.items(), ("persist", None)):
        if name not in raw and tiers is None:
            continue
        section = raw.get(name)
        if not isinstance(section, dict):
            raise OptionsError(f"{where}: field {name!r} must be an object of tier -> seconds"
                               + (f" with {', '.join(tiers)}" if tiers else "") + f", got {section!r}"[:200])
        for tier in tiers or ():
            if tier not in section:
                raise OptionsError(f"{where}: field {name}.{tier} is missing (seconds)")
        for tier, value in section.items():
            _seconds(where, f"{name}.{tier}", value)
    if "restart" in raw:
        _seconds(where, "restart", raw["restart"])
    if "per_step" in raw:
        _per_step(where, raw["per_step"])
    return raw


def _machine_file(where: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A costs file with a ``machine`` section: only ``machine`` (a subset of ``MACHINE_FIELDS``, each a number in
    its range; the rest take ``Machine``'s defaults), ``per_step`` and ``measured`` (the list of the machine's
    fields measured rather than assumed, each one of them: shown by the command)."""
    unknown = sorted(set(raw) - {"machine", "per_step", "measured"})
    if unknown:
        raise OptionsError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} beside 'machine' (per_step, "
                           "measured; fixed seconds such as stall or restore go in a file without a machine)"[:400])
    section = raw["machine"]
    if not isinstance(section, dict):
        raise OptionsError(f"{where}: field 'machine' must be an object of field -> number, got {section!r}"[:200])
    for name, value in section.items():
        bounds = MACHINE_FIELDS.get(name)
        if bounds is None:
            raise OptionsError(f"{where}: unknown field machine.{name[:60]!r} (known: {', '.join(MACHINE_FIELDS)})"
                               [:500])
        if not _in_range(value, *bounds):
            raise OptionsError(f"{where}: field machine.{name} must be a number from {bounds[0]:g} to "
                               f"{bounds[1]:g}, got {_show(value)}")
    measured = raw.get("measured", [])
    if not isinstance(measured, list) or len(measured) > len(MACHINE_FIELDS) + 1 or \
            any(not isinstance(m, str) or (m not in MACHINE_FIELDS and m != "per_step") for m in measured):
        raise OptionsError(f"{where}: field 'measured' must be a list of machine fields (or \"per_step\"), got "
                           f"{_show(measured)}")
    if "per_step" in raw:
        _per_step(where, raw["per_step"])
    return raw


def _per_step(where: str, section: Any) -> None:
    """``per_step``: exactly the ``PER_STEP_FIELDS``, each a finite number in its range."""
    if not isinstance(section, dict) or set(section) != set(PER_STEP_FIELDS):
        raise OptionsError(f"{where}: field 'per_step' must be an object with exactly "
                           f"{', '.join(PER_STEP_FIELDS)}, got {section!r}"[:300])
    for name, (low, high) in PER_STEP_FIELDS.items():
        if not _in_range(section[name], low, high):
            raise OptionsError(f"{where}: field per_step.{name} must be a number from {low:g} to {high:g}, got "
                               f"{_show(section[name])}")


def _seconds(where: str, field: str, value: Any) -> None:
    if not _in_range(value, 0.0, 1e9):
        raise OptionsError(f"{where}: field {field} must be a number of seconds from 0 to 1e9, got {_show(value)}")


def _in_range(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is a JSON number (int or float, not bool) from ``low`` to ``high``: compared as a number,
    never converted first (an int of 400 digits is compared exactly; a float beyond the range is refused the same)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (not isinstance(value, float) or math.isfinite(value)) and low <= value <= high


def _show(value: Any) -> str:
    """``value`` for an error message: its type and at most 60 characters of it (an int may have thousands of
    digits, more than repr() of an int converts)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 190:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
