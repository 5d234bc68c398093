"""The ``liferaft`` command: look into a checkpoint without writing any Python.

    liferaft inspect PATH               keys, shapes, dtypes, chunks and bytes (from the manifest only)
    liferaft verify PATH                re-hash every block of every chunk; exit status 1 if anything is wrong
    liferaft read PATH [--key K]...     read the checkpoint and print one line per leaf
    liferaft plan [--costs F.json] ...  expected goodput of no tiers / remote only / liferaft's tiers at scale

Uses only the public API (``import liferaft``). Errors are printed to stderr as one message and give exit
status 1; usage errors give exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Iterator, Sequence

import numpy as np
import torch

import liferaft

REPR_LIMIT = 80


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liferaft", description="Inspect, verify and read liferaft checkpoints.")
    parser.add_argument("--version", action="version", version=f"liferaft {liferaft.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("inspect", help="summarize a checkpoint (keys, shapes, dtypes, chunks, bytes)")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL")

    p = sub.add_parser("verify", help="check the checksum of every stored byte")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL")

    p = sub.add_parser("read", help="read the checkpoint and print a summary of each leaf")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="K",
                   help="only this key or key prefix ('model' selects model.*); repeatable")
    p.add_argument("--allow-pickle", action="store_true",
                   help="decode pickled values (runs code from the checkpoint: only for trusted checkpoints)")
    p = sub.add_parser("plan", help="goodput simulator: expected useful share of training time at 1k/16k/100k GPUs")
    p.add_argument("--costs", metavar="F.json", help="measured costs in seconds: {\"stall\": {\"memory\": s, "
                   "\"remote\": s}, \"persist\": {...}, \"restore\": {\"memory\": s, \"peer\": s, \"remote\": s}, "
                   "\"restart\": s}; default: DEFAULT_COSTS in liferaft/cli.py")
    p.add_argument("--gpus", default="1000,16000,100000", help="comma list of GPU counts")
    p.add_argument("--failures-per-gpu-hour", type=float, default=2e-5)
    p.add_argument("--node-share", type=float, default=0.5, help="share of failures that take a node down")
    p.add_argument("--multi-node-share", type=float, default=0.02,
                   help="share of failures that take several nodes (and maybe both copies of a replica) down")
    return parser


#: Default costs for 1 GiB of state per rank: stalls and memory/peer restores as measured on this project's VM
#: (README: bench_async, bench_tiers); remote persist and restore assume each rank gets ~50 MB/s of a shared
#: object store at scale (20 s per GiB); restart = rescheduling and process start. Pass measured ones with --costs.
DEFAULT_COSTS = {"stall": {"memory": 0.15, "remote": 0.15}, "persist": {"memory": 2.0, "remote": 20.0},
                 "restore": {"memory": 0.6, "peer": 2.0, "remote": 20.0}, "restart": 120.0}


def _cmd_plan(args: argparse.Namespace) -> int:
    from liferaft.planning.goodput import Costs, table

    raw = DEFAULT_COSTS
    if args.costs:
        with open(args.costs) as f:
            raw = json.load(f)
    costs = Costs(stall=raw["stall"], restore=raw["restore"], restart=float(raw.get("restart", 120.0)),
                  persist=raw.get("persist", {}))
    gpus = [int(x) for x in args.gpus.split(",") if x]
    print(f"costs (s{'' if args.costs else ', defaults'}): stall {dict(costs.stall)}, persist "
          f"{dict(costs.persist)}, restore {dict(costs.restore)}, restart {costs.restart:.0f}")
    print(table(costs, gpus, failures_per_gpu_hour=args.failures_per_gpu_hour, node_share=args.node_share,
                multi_node_share=args.multi_node_share))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = liferaft.inspect(args.path)
    print(info)
    created = datetime.datetime.fromtimestamp(info.created_unix, tz=datetime.timezone.utc)
    print(f"save id {info.save_id}, created {created.isoformat(timespec='seconds')}")
    if info.metadata:
        print(f"metadata: {json.dumps(info.metadata, sort_keys=True, default=repr)}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    report = liferaft.verify(args.path)
    print(f"OK {report.path}: {report.chunks} chunk(s), {report.bytes_checked} bytes verified")
    return 0


def _short_repr(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= REPR_LIMIT else r[:REPR_LIMIT - 3] + "..."


def _describe(v: Any) -> tuple[str, str]:
    """(type, details) of one leaf."""
    if isinstance(v, torch.Tensor):
        return "tensor", f"shape={list(v.shape)} dtype={str(v.dtype).removeprefix('torch.')}"
    if isinstance(v, np.ndarray):
        return "numpy", f"shape={list(v.shape)} dtype={v.dtype}"
    if isinstance(v, liferaft.PerRank):
        return "per-rank", f"{len(v)} rank(s): {_short_repr(tuple(v))}"
    if isinstance(v, (bytes, bytearray)):
        return type(v).__name__, f"{len(v)} bytes" + (f": {_short_repr(bytes(v))}" if len(v) <= 32 else "")
    return type(v).__name__, _short_repr(v)


def _leaves(node: Any, path: tuple[Any, ...], leaf_keys: set[str]) -> Iterator[tuple[str, Any]]:
    """(key, value) of every leaf in a tree returned by liferaft.read, in order.

    A node is a leaf when its key is a leaf key of the checkpoint (so a dict stored as one plain value stays
    one leaf); otherwise it is a container and is walked. Empty containers are reported as leaves.
    """
    key = ".".join(str(p) for p in path)
    if path and key in leaf_keys:
        yield key, node
        return
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:  # not expected from liferaft.read, but never drop a value
        yield key, node
        return
    empty = True
    for k, child in items:
        empty = False
        yield from _leaves(child, path + (k,), leaf_keys)
    if empty and path:
        yield key, node


def _cmd_read(args: argparse.Namespace) -> int:
    info = liferaft.inspect(args.path)
    leaf_keys = {t.key for t in info.tensors} | set(info.values)
    tree = liferaft.read(args.path, args.keys, options=liferaft.LoadOptions(allow_pickle=args.allow_pickle))
    rows = [(key, *_describe(v)) for key, v in _leaves(tree, (), leaf_keys)]
    if not rows:
        print("(no leaves)")
        return 0
    kw = max(len(r[0]) for r in rows)
    tw = max(len(r[1]) for r in rows)
    for key, typ, details in rows:
        print(f"{key:<{kw}}  {typ:<{tw}}  {details}")
    return 0


_COMMANDS = {"inspect": _cmd_inspect, "verify": _cmd_verify, "read": _cmd_read, "plan": _cmd_plan}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``liferaft`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2), --help / --version (0)
        return e.code if isinstance(e.code, int) else 1
    try:
        return _COMMANDS[args.command](args)
    except (liferaft.LiferaftError, OSError) as e:
        print(f"liferaft {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
