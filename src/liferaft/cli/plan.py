"""``liferaft plan``: the goodput model at scale (docs/cli/plan.md)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

#: Default costs for 1 GiB of state per rank: stalls and memory/peer restores as measured on this project's VM
#: (README: bench_async, bench_tiers); remote persist and restore assume each rank gets ~50 MB/s of a shared
#: object store at scale (20 s per GiB); restart = rescheduling and process start. Pass measured ones with --costs.
DEFAULT_COSTS: Mapping[str, Any] = {
    "stall": {"memory": 0.15, "remote": 0.15}, "persist": {"memory": 2.0, "remote": 20.0},
    "restore": {"memory": 0.6, "peer": 2.0, "remote": 20.0}, "restart": 120.0}


def add_parsers(sub: Any) -> None:
    """Add ``plan`` to the subcommands ``sub``."""
    p = sub.add_parser("plan", help="goodput simulator: expected useful share of training time at 1k/16k/100k GPUs")
    p.add_argument("--costs", metavar="F.json", help="measured costs in seconds: {\"stall\": {\"memory\": s, "
                   "\"remote\": s}, \"persist\": {...}, \"restore\": {\"memory\": s, \"peer\": s, \"remote\": s}, "
                   "\"restart\": s}; default: DEFAULT_COSTS in liferaft/cli/plan.py")
    p.add_argument("--gpus", default="1000,16000,100000", help="comma list of GPU counts")
    p.add_argument("--failures-per-gpu-hour", type=float, default=2e-5)
    p.add_argument("--node-share", type=float, default=0.5, help="share of failures that take a node down")
    p.add_argument("--multi-node-share", type=float, default=0.02,
                   help="share of failures that take several nodes (and maybe both copies of a replica) down")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the three plans' goodput at each GPU count (a table, or JSON)."""
    # not public: the goodput model is pure arithmetic beside the manager's policies, not part of the API
    from liferaft.manager.goodput import Cluster, Costs, compare, table

    raw = DEFAULT_COSTS
    if args.costs:
        with open(args.costs) as f:
            raw = json.load(f)
    costs = Costs(stall=raw["stall"], restore=raw["restore"], restart=float(raw.get("restart", 120.0)),
                  persist=raw.get("persist", {}))
    gpus = [int(x) for x in args.gpus.split(",") if x]
    if args.json:
        print(json.dumps([{"gpus": n, "plan": p.name, "intervals_s": dict(p.intervals), "goodput": p.goodput}
                          for n in gpus for p in compare(costs, Cluster(
                              gpus=n, failures_per_gpu_hour=args.failures_per_gpu_hour, node_share=args.node_share,
                              multi_node_share=args.multi_node_share))]))
        return 0
    print(f"costs (s{'' if args.costs else ', defaults'}): stall {dict(costs.stall)}, persist "
          f"{dict(costs.persist)}, restore {dict(costs.restore)}, restart {costs.restart:.0f}")
    print(table(costs, gpus, failures_per_gpu_hour=args.failures_per_gpu_hour, node_share=args.node_share,
                multi_node_share=args.multi_node_share))
    return 0
