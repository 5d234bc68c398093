"""``liferaft plan``: the goodput model at scale (docs/cli/plan.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

from liferaft.cli.args import integers, number
from liferaft.errors import CorruptCheckpointError, OptionsError
from liferaft.format import jsonsafe

#: Largest ``--costs`` file read (bytes), and how deep its JSON may nest.
MAX_COSTS_BYTES = 1 << 20
MAX_COSTS_DEPTH = 8
#: The fields ``--costs`` must give (tier → seconds); ``persist`` (tier → seconds) and ``restart`` are optional.
REQUIRED_COSTS = {"stall": ("memory", "remote"), "restore": ("memory", "peer", "remote")}
#: The optional ``per_step`` object (the per-step log, measured by benchmarks/bench_steps.py): field → (low, high)
PER_STEP_FIELDS = {"overhead": (0.0, 1.0), "step": (1e-6, 1e6), "restore": (0.0, 1e9), "lost_steps": (0.0, 1e6)}

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
                   "\"restart\": s, optional \"per_step\": {\"overhead\": share, \"step\": s, \"restore\": s, "
                   "\"lost_steps\": n}}; default: DEFAULT_COSTS in liferaft/cli/plan.py")
    p.add_argument("--gpus", type=integers(1), default=[1000, 16000, 100000], help="comma list of GPU counts")
    p.add_argument("--failures-per-gpu-hour", type=number(1e-12), default=2e-5)   # (1e-320: an infinite interval)
    p.add_argument("--node-share", type=number(0, 1), default=0.5, help="share of failures that take a node down")
    p.add_argument("--multi-node-share", type=number(0, 1), default=0.02,
                   help="share of failures that take several nodes (and maybe both copies of a replica) down")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the three plans' goodput at each GPU count (a table, or JSON)."""
    # not public: the goodput model is pure arithmetic beside the manager's policies, not part of the API
    from liferaft.manager.goodput import Cluster, Costs, compare, table

    raw = load_costs(args.costs) if args.costs else DEFAULT_COSTS
    costs = Costs(stall=raw["stall"], restore=raw["restore"], restart=float(raw.get("restart", 120.0)),
                  persist=raw.get("persist", {}), per_step=raw.get("per_step"))
    gpus = args.gpus
    if args.json:
        print(json.dumps([{"gpus": n, "plan": p.name, "intervals_s": dict(p.intervals), "goodput": p.goodput}
                          for n in gpus for p in compare(costs, Cluster(
                              gpus=n, failures_per_gpu_hour=args.failures_per_gpu_hour, node_share=args.node_share,
                              multi_node_share=args.multi_node_share))]))
        return 0
    print(f"costs (s{'' if args.costs else ', defaults'}): stall {dict(costs.stall)}, persist "
          f"{dict(costs.persist)}, restore {dict(costs.restore)}, restart {costs.restart:.0f}"
          + (f", per_step {dict(costs.per_step)}" if costs.per_step is not None else ""))
    print(table(costs, gpus, failures_per_gpu_hour=args.failures_per_gpu_hour, node_share=args.node_share,
                multi_node_share=args.multi_node_share))
    return 0


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
        raise OptionsError(f"{where}: expected a JSON object with stall, restore, persist and restart, got "
                           f"{type(raw).__name__}")
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
