"""The ``liferaft`` command: look into a checkpoint without writing any Python.

    liferaft inspect PATH               keys, shapes, dtypes, chunks and bytes (from the manifest only)
    liferaft verify PATH                re-hash every block of every chunk; exit status 1 if anything is wrong
    liferaft read PATH [--key K]...     read the checkpoint and print one line per leaf
    liferaft plan [--costs F.json] ...  expected goodput of no tiers / remote only / liferaft's tiers at scale
    liferaft ls ROOT                    steps under a CheckpointManager root: status, size, age, writer, references
    liferaft gc ROOT --keep-last N ...  the manager's retention from the command line (--dry-run to preview)
    liferaft diff A B [--key GLOB]...   keys added / removed / changed, max abs and relative difference per tensor
    liferaft convert SRC DST --to FMT   liferaft ↔ safetensors, torch (torch.save), dcp; → hf (a loadable model)

Every command that takes a checkpoint (inspect, verify, read, diff, convert) takes each format
``liferaft.formats.sources`` detects: liferaft, a DCP folder, safetensors (file or folder), a ``torch.save`` file;
ls and gc take a CheckpointManager root and say so when given a checkpoint.

Uses only the public API (``import liferaft``) and ``liferaft.tools``. ``--json`` (ls, gc, diff, verify) prints
one JSON document for scripts. Errors are printed to stderr as one line and give exit status 1 (``--debug``: with
the traceback); usage errors give exit status 2; ``diff`` exits 1 when the checkpoints differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Iterator, Sequence

import numpy as np
import torch

import liferaft

REPR_LIMIT = 80


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liferaft", description="Inspect, verify, compare, convert and manage liferaft checkpoints.")
    parser.add_argument("--version", action="version", version=f"liferaft {liferaft.__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("inspect", help="summarize a checkpoint (keys, shapes, dtypes, chunks, bytes)")
    p.add_argument("--flat", action="store_true", help="one line per key instead of the tree")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL")
    p.add_argument("glob", nargs="*", metavar="KEY-GLOB", help="per-key table of the tensors matching these globs")
    p.add_argument("--stats", action="store_true", help="min/max/mean/std/NaN/Inf per tensor (reads the data)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("verify", help="check the checksum of every stored byte (DCP, torch.save: their zip "
                       "CRC-32s; safetensors: no checksums, layout and readability only)")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL, or a DCP / safetensors / torch.save one")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("read", help="read the checkpoint and print a summary of each leaf")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL, or a DCP / safetensors / torch.save one")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="K",
                   help="only this key or key prefix ('model' selects model.*); repeatable")
    p.add_argument("--allow-pickle", action="store_true",
                   help="decode pickled values (runs code from the checkpoint: only for trusted checkpoints)")
    p.add_argument("--json", action="store_true", help="one object per leaf: key, type, details")
    p = sub.add_parser("ls", help="list the steps under a CheckpointManager root")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--verify", action="store_true", help="re-hash every committed step (reads all its data)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("gc", help="delete steps the retention policy does not keep (never referenced ones)")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=int)
    p.add_argument("--keep-every", type=int)
    p.add_argument("--keep-best", type=int)
    p.add_argument("--metric")
    p.add_argument("--mode", choices=["min", "max"], default="min")
    p.add_argument("--incomplete", action="store_true", help="also remove steps without a commit marker")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("diff", help="compare two checkpoints key by key (exit status 1 if they differ); either "
                       "may also be a safetensors folder/file, a DCP folder or a torch.save file")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="GLOB", help="only keys matching; repeatable")
    p.add_argument("--tolerance", type=float, default=0.0, help="max abs difference still counted as equal")
    p.add_argument("--rename", nargs=2, action="append", metavar=("REGEX", "REPLACEMENT"),
                   help="rename B's keys to A's names before comparing (applied in order); repeatable")
    p.add_argument("--module", metavar="KEY", help="compare A's subtree KEY with all of B (an hf export of that "
                   "module): A's keys under KEY, B's keys read as KEY.<key>")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("convert", help="convert between liferaft, safetensors, torch.save and DCP, or export a "
                       "model as a Hugging Face folder (--to hf)")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", required=True, choices=["liferaft", "safetensors", "hf", "torch", "dcp"],
                   help="hf: a folder from_pretrained loads (one module's weights, its config); safetensors: "
                   "every tensor under its full key")
    p.add_argument("--from", dest="source", choices=["liferaft", "safetensors", "hf", "torch", "dcp"],
                   help="format of SRC (default: guessed from what is there; hf = safetensors)")
    p.add_argument("--module", metavar="KEY", help="--to hf: the subtree that is the model (default: the one "
                   "saved as an nn.Module; needed when there are several; '' for every tensor)")
    p.add_argument("--config", metavar="PATH", help="--to hf: a config.json, or a model folder whose config and "
                   "tokenizer files are copied (default: those recorded when SRC was imported from one)")
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors shard (default 5)")
    p.add_argument("--dtype", help="cast floating-point tensors on export (e.g. bfloat16)")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="GLOB", help="only keys matching; repeatable")
    p.add_argument("--rename", nargs=2, action="append", metavar=("REGEX", "REPLACEMENT"),
                   help="rename keys by regex (applied in order); repeatable")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="goodput simulator: expected useful share of training time at 1k/16k/100k GPUs")
    p.add_argument("--costs", metavar="F.json", help="measured costs in seconds: {\"stall\": {\"memory\": s, "
                   "\"remote\": s}, \"persist\": {...}, \"restore\": {\"memory\": s, \"peer\": s, \"remote\": s}, "
                   "\"restart\": s}; default: DEFAULT_COSTS in liferaft/cli.py")
    p.add_argument("--gpus", default="1000,16000,100000", help="comma list of GPU counts")
    p.add_argument("--failures-per-gpu-hour", type=float, default=2e-5)
    p.add_argument("--node-share", type=float, default=0.5, help="share of failures that take a node down")
    p.add_argument("--multi-node-share", type=float, default=0.02,
                   help="share of failures that take several nodes (and maybe both copies of a replica) down")
    p.add_argument("--json", action="store_true")
    return parser


#: Default costs for 1 GiB of state per rank: stalls and memory/peer restores as measured on this project's VM
#: (README: bench_async, bench_tiers); remote persist and restore assume each rank gets ~50 MB/s of a shared
#: object store at scale (20 s per GiB); restart = rescheduling and process start. Pass measured ones with --costs.
DEFAULT_COSTS = {"stall": {"memory": 0.15, "remote": 0.15}, "persist": {"memory": 2.0, "remote": 20.0},
                 "restore": {"memory": 0.6, "peer": 2.0, "remote": 20.0}, "restart": 120.0}


def _cmd_plan(args: argparse.Namespace) -> int:
    from liferaft.manager.goodput import Costs, table

    raw = DEFAULT_COSTS
    if args.costs:
        with open(args.costs) as f:
            raw = json.load(f)
    costs = Costs(stall=raw["stall"], restore=raw["restore"], restart=float(raw.get("restart", 120.0)),
                  persist=raw.get("persist", {}))
    gpus = [int(x) for x in args.gpus.split(",") if x]
    if args.json:
        from liferaft.manager.goodput import Cluster, compare

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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from liferaft.tools.convert import detect_format

    if args.glob or args.stats or args.json:
        return _inspect_keys(args)
    fmt = detect_format(args.path)
    if fmt != "liferaft":
        _print_other(args.path, fmt, args.flat)
        return 0
    info = liferaft.inspect(args.path)
    if args.flat:
        print(info)
    else:
        print("\n".join(str(info).splitlines()[:2]))
        _print_tree(args.path)
    created = datetime.datetime.fromtimestamp(info.created_unix, tz=datetime.timezone.utc)
    print(f"save id {info.save_id}, created {created.isoformat(timespec='seconds')}")
    if info.metadata:
        meta = dict(info.metadata)
        hf = meta.get("hf")
        if isinstance(hf, dict) and isinstance(hf.get("files"), dict):     # (file contents: names only)
            meta["hf"] = {**hf, "files": sorted(hf["files"])}
        print(f"metadata: {json.dumps(meta, sort_keys=True, default=repr)}")
    return 0


def _print_tree(path: str) -> None:
    """The keys of a liferaft checkpoint as a tree of their path parts (manifest only), children in saved order."""
    from liferaft.core.commit import open_checkpoint
    from liferaft.storage import resolve
    from liferaft.tools.stats import describe

    m = open_checkpoint(resolve(path))
    leaf = {e.path: e.key for e in m.tensors} | {v.path: v.key for v in m.values}
    orders = {c.path: list(c.children) for c in m.containers if c.children is not None}
    classes = {c.path: c.cls.rsplit(".", 1)[-1] for c in m.containers if c.cls}
    _tree(leaf, {i.key: i for i in describe(path)}, [c.path for c in m.containers], orders, classes)


def _print_other(path: str, fmt: str, flat: bool = False) -> None:
    """Header and key tree (or one line per key) of a DCP folder, safetensors folder/file or torch.save file."""
    from liferaft.formats.sources import open_source
    from liferaft.tools.stats import describe_side

    side = open_source(path)
    info = {i.key: i for i in describe_side(side)}
    keys = list(info) + [k for k in side.values if k not in info]
    size = sum(i.nbytes for i in info.values())
    check = "liferaft verify checks its zip CRC-32s" if fmt in ("dcp", "torch") else "no checksums to verify"
    print(f"{fmt} checkpoint {path} (not liferaft: {check})\n{len(info)} tensors, {len(side.values)} "
          f"values, {size / 2**20:.1f} MiB of tensors")
    if flat:
        for k in keys:
            i = info.get(k)
            print(f"  {k:<50} value" if i is None else f"  {k:<50} {i.dtype:<9} {str(list(i.shape)):<20} "
                  f"{i.chunks:>4} chunk(s) {i.nbytes / 2**20:10.3f} MiB")
        return
    _tree({tuple(side.paths.get(k, k.split("."))): k for k in keys}, info, [], {})


def _tree(leaf: dict[tuple, str], info: dict[str, Any], containers: list[tuple], orders: dict[tuple, list],
          classes: dict[tuple, str] | None = None) -> None:
    """Print leaves (path -> key) as a tree: containers with their number of keys and bytes (and the class of a
    saved object: ``classes``), tensors with dtype, shape, bytes, chunks, the sharding as saved and codecs
    (``info``: key -> KeyInfo), values as "value"."""
    kids: dict[tuple, list] = {}
    for p in list(leaf) + containers:
        for i in range(1, len(p) + 1):
            siblings = kids.setdefault(tuple(p[:i - 1]), [])
            if p[i - 1] not in siblings:
                siblings.append(p[i - 1])
    for p, order in orders.items():                          # children in the order they were saved
        if p in kids:
            rank = {k: i for i, k in enumerate(order)}
            kids[p].sort(key=lambda k: rank.get(k, len(rank)))
    totals: dict[tuple, list[int]] = {}
    for p, key in leaf.items():
        for i in range(len(p)):
            t = totals.setdefault(tuple(p[:i]), [0, 0])
            t[0] += info[key].nbytes if key in info else 0
            t[1] += 1

    def walk(node: tuple, depth: int) -> None:
        for child in kids.get(node, []):
            p, pad = node + (child,), "  " * depth
            key = leaf.get(p)
            if key is None:
                n = f"{totals[p][1]} key(s)"
                cls = (classes or {}).get(p)
                print(f"  {pad + str(child) + '/':<50} {'':<9} {n:<16} {totals[p][0] / 2**20:12.3f} MiB"
                      + (f"  {cls}" if cls else ""))
                walk(p, depth + 1)
            elif key not in info:
                print(f"  {pad + str(child):<50} value")
            else:
                k = info[key]
                print(f"  {pad + str(child):<50} {k.dtype:<9} {str(list(k.shape)):<16} {k.nbytes / 2**20:12.3f} MiB"
                      f"  {k.chunks} chunk(s)  {k.layout}  {'+'.join(k.codecs)}" + (f"  lossy: {k.lossy}" if k.lossy
                                                                                       else ""))
    if () in leaf:                                          # the state was a single tensor or value
        print(f"  {leaf[()]}")
    walk((), 0)


def _ranges(xs: Any) -> str:
    """1, 2, 3, 7 -> "1-3, 7"."""
    out: list[list[int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in out) or "-"


def _inspect_keys(args: argparse.Namespace) -> int:
    from liferaft.tools.stats import describe

    infos = describe(args.path, args.glob or None, stats=args.stats)
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], default=list))
        return 0
    for i in infos:
        line = (f"{i.key:<44} {i.dtype:<9} {str(list(i.shape)):<16} {i.nbytes / 2**20:9.3f} MiB  stored here "
                f"{i.stored_bytes / 2**20:9.3f} MiB  {i.chunks} chunk(s) in {i.files} file(s)  {'+'.join(i.codecs)}")
        if i.lossy:
            line += f"  lossy: {i.lossy}"
        print(line)
        print(f"{'':<44} saved as: {i.layout}; by rank(s) {_ranges(i.ranks)}")
        if i.stats:
            st = i.stats
            print(f"{'':<44} min {st['min']:.4g}  max {st['max']:.4g}  mean {st['mean']:.4g}  std {st['std']:.4g}  "
                  f"NaN {st['nan']}  Inf {st['inf']}")
    return 0


def _verify_other(args: argparse.Namespace, fmt: str) -> int:
    """verify for a DCP folder, a torch.save file or safetensors: the checks their format allows."""
    from liferaft.formats.sources import NAMES, check_source
    from liferaft.tools.progress import Progress

    p = args.path
    total = os.path.getsize(p) if os.path.isfile(p) else \
        sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
    with Progress(total, "verify", None if not args.json else False) as tick:
        r = check_source(args.path, progress=tick)
    if args.json:
        print(json.dumps({"path": r.path, "format": fmt, "ok": not r.faults, "checksums": r.records > 0,
                          "records": r.records, "crc_bytes": r.crc_bytes, "bytes_read": r.bytes_read,
                          "unchecked": list(r.unchecked), "faults": list(r.faults)}))
        return 1 if r.faults else 0
    if r.faults:
        print(f"FAILED {args.path}: {len(r.faults)} fault(s)")
        for x in r.faults:
            print(f"  {x}")
        print(f"liferaft verify: error: {args.path}: {len(r.faults)} fault(s) found (listed above) in this "
              f"{NAMES[fmt]}; its data is damaged or incomplete", file=sys.stderr)
        return 1
    if r.records:
        print(f"OK {r.path}: {r.records} zip record(s), {r.crc_bytes} bytes checked against their CRC-32 "
              f"({NAMES[fmt]}: {'DCP has no checksums of its own; ' if fmt == 'dcp' else ''}torch.save archives "
              "carry CRC-32s)")
        for x in r.unchecked:
            print(f"  not checked: {x}")
    else:
        layout = ", header and layout consistent" if fmt == "safetensors" else ""
        print(f"READ {r.path}: {r.bytes_read} bytes read{layout}; NOT verified: {'; '.join(r.unchecked)}, so damaged "
              "values of the right length cannot be found")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from liferaft.formats.sources import detect
    from liferaft.tools.progress import Progress

    fmt = detect(args.path)
    if fmt != "liferaft":
        return _verify_other(args, fmt)
    info = liferaft.inspect(args.path)
    try:
        with Progress(sum(t.nbytes for t in info.tensors), "verify", None if not args.json else False) as tick:
            report = liferaft.verify(args.path, progress=tick)
    except liferaft.CorruptCheckpointError as e:         # the report: every fault on stdout, one error line
        lines = str(e).split("\n")
        faults = [x.strip() for x in lines[1:] if x.strip()] or [lines[0]]
        if args.json:
            print(json.dumps({"path": str(args.path), "ok": False, "faults": faults}))
            return 1
        print(f"FAILED {args.path}: {len(faults)} fault(s)")
        for x in faults:
            print(f"  {x}")
        print(f"liferaft verify: error: {args.path}: {len(faults)} fault(s) found (listed above); the stored data is "
              "damaged: restore from another checkpoint or copy", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"path": report.path, "ok": True, "chunks": report.chunks,
                          "bytes_checked": report.bytes_checked}))
    else:
        print(f"OK {report.path}: {report.chunks} chunk(s), {report.bytes_checked} bytes verified")
    return 0


def _age(created: float | None) -> str:
    if created is None:
        return "-"
    import time

    s = max(0.0, time.time() - created)
    return f"{s / 86400:.1f} d" if s >= 86400 else f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def _cmd_ls(args: argparse.Namespace) -> int:
    from liferaft.tools.steps import ls

    total = 0
    if args.verify and not args.json:
        from liferaft.tools.steps import ls as listing

        for i in listing(args.root):                       # what the re-hash will read, for the bar
            if i.status == "committed":
                total += sum(t.nbytes for t in liferaft.inspect(i.path).tensors)
    from liferaft.tools.progress import Progress

    with Progress(total, "verify", None if args.verify and not args.json else False) as tick:
        steps = ls(args.root, verify=args.verify, progress=tick)
    if args.json:
        print(json.dumps([{"step": i.step, "status": i.status, "reason": i.reason, "bytes": i.nbytes,
                           "created_unix": i.created_unix, "world_size": i.world_size, "job_id": i.job_id,
                           "tiers": list(i.tiers), "depends_on": list(i.depends_on), "pinned": i.pinned,
                           "metrics": dict(i.metrics)} for i in steps]))
        return 0
    jobs = [_short(i.job_id or "-", 64) for i in steps]
    width = max([3] + [len(j) for j in jobs])
    print(f"{'step':>10}  {'status':<10} {'MiB':>9}  {'age':>8}  {'ranks':>5}  {'tiers':<6} {'job':<{width}} "
          "references / reason")
    for i, job in zip(steps, jobs):
        note = " ".join(i.reason.replace(i.path, "").split()).lstrip(": ") if i.status != "committed" else \
            (("refs " + ",".join(map(str, i.depends_on))) if i.depends_on else "") + (" pinned" if i.pinned else "")
        print(f"{i.step:>10}  {i.status:<10} {i.nbytes / 2**20:>9.1f}  {_age(i.created_unix):>8}  "
              f"{i.world_size or '-':>5}  {','.join(i.tiers) or '-':<6} {job:<{width}} {note}")
    return 0


def _short(text: str, limit: int) -> str:
    """``text`` whole, or its start and end around '…' when longer than ``limit`` (job ids end in what tells
    two launches apart: a pid and start time, a uuid)."""
    return text if len(text) <= limit else text[:limit // 2 - 1] + "…" + text[-(limit - limit // 2):]


def _cmd_gc(args: argparse.Namespace) -> int:
    from liferaft.tools.steps import gc

    r = gc(args.root, keep_last=args.keep_last, keep_every=args.keep_every, keep_best=args.keep_best,
           metric=args.metric, mode=args.mode, dry_run=args.dry_run, incomplete=args.incomplete)
    if args.json:
        print(json.dumps({"deleted": list(r.deleted), "kept": list(r.kept), "freed_bytes": r.freed_bytes,
                          "dry_run": r.dry_run}))
    else:
        verb = "would delete" if r.dry_run else "deleted"
        print(f"{verb} {len(r.deleted)} step(s) {list(r.deleted)}, {r.freed_bytes / 2**20:.1f} MiB; "
              f"kept {list(r.kept)}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from liferaft.tools.convert import convert, detect_format
    from liferaft.tools.progress import Progress

    src = {"hf": "safetensors"}.get(args.source or detect_format(args.src), args.source or detect_format(args.src))
    to = args.to
    hf = {"module": args.module, "config": args.config}
    from liferaft.tools.progress import FolderGrowth

    if src == "liferaft":
        tensors = liferaft.inspect(args.src).tensors
        if to == "hf":                                     # the bar counts the model's bytes only
            from liferaft.core.commit import open_checkpoint
            from liferaft.storage import resolve
            from liferaft.tools.hf_folder import model_subtree

            prefix, _ = model_subtree(open_checkpoint(resolve(args.src)), args.module)
            tensors = tuple(t for t in tensors if t.kind == "tensor" and (not prefix or t.key.startswith(prefix + ".")))
        total = sum(t.nbytes for t in tensors)
    else:                                                  # an import: the bar follows the files written
        total = os.path.getsize(args.src) if os.path.isfile(args.src) else \
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.src) for f in fs)
    with Progress(total, "export" if src == "liferaft" else "import", None if not args.json else False) as tick:
        if src == "liferaft":
            r = convert(args.src, args.dst, to, source=src, keys=args.keys, dtype=args.dtype,
                        rename=[tuple(x) for x in args.rename or []],
                        max_shard_bytes=int(args.max_shard_size * 1e9), progress=tick, **hf)
        else:
            with FolderGrowth(args.dst, tick):
                r = convert(args.src, args.dst, to, source=src, keys=args.keys, dtype=args.dtype,
                            rename=[tuple(x) for x in args.rename or []],
                            max_shard_bytes=int(args.max_shard_size * 1e9), **hf)
    if args.json:
        print(json.dumps({"from": src, "to": to, "files": list(r.files), "tensors": r.tensors, "bytes": r.bytes}
                         | ({"module": r.module, "notes": list(r.notes)} if to == "hf" else {})))
    else:
        print(f"{src} → {to}: {args.dst} ({r.tensors} tensor(s), {len(r.files)} file(s), {r.bytes / 2**20:.1f} MiB)")
        for note in r.notes:
            print(f"  {note}")
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from liferaft.tools.convert import detect_format
    from liferaft.tools.diff import diff
    from liferaft.tools.progress import Progress

    total = sum(t.nbytes for t in liferaft.inspect(args.a).tensors if not args.module or
                t.key.startswith(args.module + ".")) if detect_format(args.a) == "liferaft" else 0
    with Progress(total, "diff", None if not args.json else False) as tick:
        r = diff(args.a, args.b, keys=args.keys, tolerance=args.tolerance, progress=tick,
                 rename=[tuple(x) for x in args.rename or []], module=args.module)
    if args.json:
        print(json.dumps({"a": r.a, "b": r.b, "identical": r.identical,
                          "keys": [k.__dict__ for k in r.keys]}))
    else:
        for k in r.changed():
            extra = f"  max abs {k.max_abs:.3g}  max rel {k.max_rel:.3g}" if k.status == "changed" and \
                (k.max_abs or k.max_rel) else ""
            print(f"{k.status:<8} {k.key}{extra}{('  ' + k.detail) if k.detail else ''}")
        n = len(r.keys)
        print(f"{'identical' if r.identical else 'different'}: {n - len(r.changed())} of {n} key(s) equal"
              + (f" (tolerance {args.tolerance:g})" if args.tolerance else ""))
    return 0 if r.identical else 1


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


def _read_other(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The rows of ``read`` for a DCP folder, safetensors or a torch.save file: every tensor read (one at a time)
    and every value decoded, under the keys that format stores (DCP: each leaf of a nested value on its own)."""
    from liferaft.formats.sources import open_source

    src = open_source(args.path, options=liferaft.LoadOptions(allow_pickle=args.allow_pickle))
    every = list(src.tensors) + [k for k in src.values if k not in src.tensors]
    chosen = set(every)
    if args.keys is not None:
        chosen = set()
        for k in args.keys:
            hit = {a for a in every if a == k or a.startswith(k + ".")}
            if not hit:
                raise liferaft.StateMismatchError(f"key {k!r} is not in the checkpoint (nor any key under it)")
            chosen |= hit
    rows = []
    for key in every:
        if key not in chosen:
            continue
        if key in src.tensors:
            _, shape, _ = src.tensors[key]
            v: Any = src.read(key, ((0,) * len(shape), tuple(shape)))
        else:
            v = src.values[key]()
        rows.append((key, *_describe(v)))
    return rows


def _cmd_read(args: argparse.Namespace) -> int:
    from liferaft.formats.sources import detect

    if detect(args.path) != "liferaft":
        rows = _read_other(args)
    else:
        info = liferaft.inspect(args.path)
        leaf_keys = {t.key for t in info.tensors} | set(info.values)
        tree = liferaft.read(args.path, args.keys, options=liferaft.LoadOptions(allow_pickle=args.allow_pickle))
        rows = [(key, *_describe(v)) for key, v in _leaves(tree, (), leaf_keys)]
    if args.json:
        print(json.dumps([{"key": k, "type": t, "details": d} for k, t, d in rows]))
        return 0
    if not rows:
        print("(no leaves)")
        return 0
    kw = max(len(r[0]) for r in rows)
    tw = max(len(r[1]) for r in rows)
    for key, typ, details in rows:
        print(f"{key:<{kw}}  {typ:<{tw}}  {details}")
    return 0


_COMMANDS = {"inspect": _cmd_inspect, "verify": _cmd_verify, "read": _cmd_read, "plan": _cmd_plan, "ls": _cmd_ls,
             "gc": _cmd_gc, "diff": _cmd_diff, "convert": _cmd_convert}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``liferaft`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2), --help / --version (0)
        return e.code if isinstance(e.code, int) else 1
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:                     # the reader went away (``liferaft inspect X | head``): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (liferaft.LiferaftError, OSError) as e:
        if args.debug:
            import traceback

            traceback.print_exc()
        lines = str(e).splitlines() or [type(e).__name__]
        print(f"liferaft {args.command}: error: {lines[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
