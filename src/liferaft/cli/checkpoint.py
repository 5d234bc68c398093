"""``liferaft inspect``, ``liferaft verify`` and ``liferaft read``: one checkpoint of any format
(docs/cli/inspect.md, docs/cli/verify.md, docs/cli/read.md)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import liferaft
from liferaft.cli.progress import Progress
from liferaft.storage import walk

REPR_LIMIT = 80


def add_parsers(sub: Any) -> None:
    """Add ``inspect``, ``verify`` and ``read`` to the subcommands ``sub``."""
    p = sub.add_parser("inspect", help="summarize a checkpoint (keys, shapes, dtypes, chunks, bytes)")
    p.add_argument("--flat", action="store_true", help="one line per key instead of the tree")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL")
    p.add_argument("glob", nargs="*", metavar="KEY-GLOB", help="per-key table of the tensors matching these globs")
    p.add_argument("--stats", action="store_true", help="min/max/mean/std/NaN/Inf per tensor (reads the data)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_inspect)

    p = sub.add_parser("verify", help="check the checksum of every stored byte (DCP, torch.save: their zip "
                       "CRC-32s; safetensors: no checksums, layout and readability only)")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL, or a DCP / safetensors / torch.save one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_verify)

    p = sub.add_parser("read", help="read the checkpoint and print a summary of each leaf")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL, or a DCP / safetensors / torch.save one")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="K",
                   help="only this key or key prefix ('model' selects model.*); repeatable")
    p.add_argument("--allow-pickle", action="store_true",
                   help="decode pickled values (runs code from the checkpoint: only for trusted checkpoints)")
    p.add_argument("--json", action="store_true", help="one object per leaf: key, type, details")
    p.set_defaults(run=run_read)


def run_inspect(args: argparse.Namespace) -> int:
    """Header, key tree (or one line per key) and metadata of a checkpoint; with key globs, --stats or --json the
    per-key table of ``liferaft.describe``."""
    if args.glob or args.stats or args.json:
        return _inspect_keys(args)
    info = liferaft.inspect(args.path)
    if info.format != "liferaft":
        _print_other(info, args.flat)
        return 0
    if args.flat:
        print(info)
    else:
        print("\n".join(str(info).splitlines()[:2]))
        _print_tree(info)
    created = datetime.datetime.fromtimestamp(info.created_unix, tz=datetime.timezone.utc)
    print(f"save id {info.save_id}, created {created.isoformat(timespec='seconds')}")
    if info.metadata:
        meta = dict(info.metadata)
        hf = meta.get("hf")
        if isinstance(hf, dict) and isinstance(hf.get("files"), dict):     # (file contents: names only)
            meta["hf"] = {**hf, "files": sorted(hf["files"])}
        print(f"metadata: {json.dumps(meta, sort_keys=True, default=repr)}")
    return 0


def _print_tree(info: liferaft.CheckpointInfo) -> None:
    """The keys of a liferaft checkpoint as a tree of their path parts (manifest only), children in saved order."""
    leaf = {p: k for k, p in info.paths.items()}
    orders = {c.path: list(c.children) for c in info.containers if c.children is not None}
    classes = {c.path: c.cls.rsplit(".", 1)[-1] for c in info.containers if c.cls}
    _tree(leaf, {i.key: i for i in liferaft.describe(info.path)}, [c.path for c in info.containers], orders, classes)


def _print_other(ci: liferaft.CheckpointInfo, flat: bool = False) -> None:
    """Header and key tree (or one line per key) of a DCP folder, safetensors folder/file or torch.save file."""
    fmt, path = ci.format, ci.path
    info = {i.key: i for i in liferaft.describe(path)}
    keys = list(info) + [k for k in ci.values if k not in info]
    size = sum(i.nbytes for i in info.values())
    check = "liferaft verify checks its zip CRC-32s" if fmt in ("dcp", "torch") else "no checksums to verify"
    print(f"{fmt} checkpoint {path} (not liferaft: {check})\n{len(info)} tensors, {len(ci.values)} "
          f"values, {size / 2**20:.1f} MiB of tensors")
    if flat:
        for k in keys:
            i = info.get(k)
            print(f"  {k:<50} value" if i is None else f"  {k:<50} {i.dtype:<9} {list(i.shape)!s:<20} "
                  f"{i.chunks:>4} chunk(s) {i.nbytes / 2**20:10.3f} MiB")
        return
    _tree({tuple(ci.paths.get(k, k.split("."))): k for k in keys}, info, [], {})


def _tree(leaf: dict[tuple, str], info: dict[str, liferaft.KeyInfo], containers: list[tuple],
          orders: dict[tuple, list], classes: dict[tuple, str] | None = None) -> None:
    """Print leaves (path -> key) as a tree: containers with their number of keys and bytes (and the class of a
    saved object: ``classes``), tensors with dtype, shape, bytes, chunks, the sharding as saved and codecs
    (``info``: key -> KeyInfo), values as "value"."""
    kids: dict[tuple, dict] = {}                             # node -> its children, in first-seen order (a dict:
    for p in list(leaf) + containers:                        # membership is O(1), so this is linear in the keys)
        for i in range(1, len(p) + 1):
            kids.setdefault(tuple(p[:i - 1]), {})[p[i - 1]] = None
    ordered: dict[tuple, list] = {node: list(children) for node, children in kids.items()}
    for p, order in orders.items():                          # children in the order they were saved
        if p in ordered:
            rank = {k: i for i, k in enumerate(order)}
            ordered[p].sort(key=lambda k: rank.get(k, len(rank)))
    totals: dict[tuple, list[int]] = {}
    for p, key in leaf.items():
        for i in range(len(p)):
            t = totals.setdefault(tuple(p[:i]), [0, 0])
            t[0] += info[key].nbytes if key in info else 0
            t[1] += 1
    out: list[str] = []
    if () in leaf:                                          # the state was a single tensor or value
        out.append(f"  {leaf[()]}")
    todo = [((), child, 0) for child in reversed(ordered.get((), []))]
    while todo:                                             # depth first, without recursion (any nesting)
        node, child, depth = todo.pop()
        p, pad = node + (child,), "  " * depth
        key = leaf.get(p)
        if key is None:
            n = f"{totals.get(p, [0, 0])[1]} key(s)"
            cls = (classes or {}).get(p)
            out.append(f"  {pad + str(child) + '/':<50} {'':<9} {n:<16} {totals.get(p, [0, 0])[0] / 2**20:12.3f} MiB"
                       + (f"  {cls}" if cls else ""))
            todo.extend((p, c, depth + 1) for c in reversed(ordered.get(p, [])))
        elif key not in info:
            out.append(f"  {pad + str(child):<50} value")
        else:
            k = info[key]
            out.append(f"  {pad + str(child):<50} {k.dtype:<9} {list(k.shape)!s:<16} {k.nbytes / 2**20:12.3f} MiB"
                       f"  {k.chunks} chunk(s)  {k.layout}  {'+'.join(k.codecs)}"
                       + (f"  lossy: {k.lossy}" if k.lossy else ""))
        if len(out) >= 4096:
            print("\n".join(out))
            out.clear()
    if out:
        print("\n".join(out))


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
    infos = liferaft.describe(args.path, args.glob or None, stats=args.stats)
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], default=list))
        return 0
    for i in infos:
        line = (f"{i.key:<44} {i.dtype:<9} {list(i.shape)!s:<16} {i.nbytes / 2**20:9.3f} MiB  stored here "
                f"{i.stored_bytes / 2**20:9.3f} MiB  {i.chunks} chunk(s) in {i.files} file(s)  {'+'.join(i.codecs)}")
        if i.lossy:
            line += f"  lossy: {i.lossy}"
        print(line)
        print(f"{'':<44} saved as: {i.layout}; by rank(s) {_ranges(i.ranks)}")
        if i.stats:
            st = i.stats
            print(f"{'':<44} min {st['min']:.10g}  max {st['max']:.10g}  mean {st['mean']:.10g}  std {st['std']:.4g}  "
                  f"NaN {st['nan']}  Inf {st['inf']}")
    return 0


_FORMAT_NAMES = {"liferaft": "liferaft checkpoint", "dcp": "DCP checkpoint",
                 "safetensors": "safetensors checkpoint", "torch": "torch.save file"}


def run_verify(args: argparse.Namespace) -> int:
    """Re-hash every stored byte (another format: the checks it allows); exit status 1 listing every fault."""
    p = args.path
    fmt = liferaft.format_of(p)

    def total() -> int:
        return sum(t.nbytes for t in liferaft.inspect(p).tensors) if fmt == "liferaft" else \
            os.path.getsize(p) if os.path.isfile(p) else \
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in walk(p) for f in fs)

    try:
        with Progress(total, "verify", None if not args.json else False) as tick:
            r = liferaft.verify(p, progress=tick)
    except liferaft.CorruptCheckpointError as e:         # the report: every fault on stdout, one error line
        if fmt != "liferaft" and "verify found" not in str(e):
            raise                                         # (an unusable index or metadata: one error line)
        lines = str(e).split("\n")
        faults = [x.strip() for x in lines[1:] if x.strip()] or [lines[0]]
        if args.json:
            print(json.dumps({"path": str(p), "format": fmt, "ok": False, "faults": faults}))
            return 1
        print(f"FAILED {p}: {len(faults)} fault(s)")
        for x in faults:
            print(f"  {x}")
        what = "the stored data is damaged: restore from another checkpoint or copy" if fmt == "liferaft" else \
            f"in this {_FORMAT_NAMES[fmt]}; its data is damaged or incomplete"
        print(f"liferaft verify: error: {p}: {len(faults)} fault(s) found (listed above); {what}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"path": r.path, "format": fmt, "ok": True, "checksums": bool(r.chunks), "chunks": r.chunks,
                          "bytes_checked": r.bytes_checked, "bytes_read": r.bytes_read,
                          "unchecked": list(r.unchecked)}))
    elif fmt == "liferaft":
        print(f"OK {r.path}: {r.chunks} chunk(s), {r.bytes_checked} bytes verified")
    elif r.chunks:
        print(f"OK {r.path}: {r.chunks} zip record(s), {r.bytes_checked} bytes checked against their CRC-32 "
              f"({_FORMAT_NAMES[fmt]}: {'DCP has no checksums of its own; ' if fmt == 'dcp' else ''}torch.save "
              "archives carry CRC-32s)")
        for x in r.unchecked:
            print(f"  not checked: {x}")
    else:
        layout = ", header and layout consistent" if fmt == "safetensors" else ""
        print(f"READ {r.path}: {r.bytes_read} bytes read{layout}; NOT verified: {'; '.join(r.unchecked)}, so damaged "
              "values of the right length cannot be found")
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


def _leaves(tree: Any, leaf_keys: set[str]) -> Iterator[tuple[str, Any]]:
    """(key, value) of every leaf in a tree returned by liferaft.read, in order.

    A node is a leaf when its key is a leaf key of the checkpoint (so a dict stored as one plain value stays
    one leaf); otherwise it is a container and is walked. Empty containers are reported as leaves. Depth first
    without recursion (any nesting); each key is built once from its parent's (linear in the keys).
    """
    todo: list[tuple[str | None, Any]] = [(None, tree)]
    while todo:
        key, node = todo.pop()
        if key is not None and key in leaf_keys:
            yield key, node
            continue
        if isinstance(node, dict):
            items: Any = list(node.items())
        elif isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        else:  # not expected from liferaft.read, but never drop a value
            yield key or "", node
            continue
        if not items and key is not None:
            yield key, node
        todo.extend((str(k) if key is None else f"{key}.{k}", child) for k, child in reversed(items))


def run_read(args: argparse.Namespace) -> int:
    """Read the checkpoint in this process and print one line (or JSON object) per leaf: key, type, details."""
    info = liferaft.inspect(args.path)
    leaf_keys = {".".join(str(x) for x in p) for p in info.paths.values()}
    tree = liferaft.read(args.path, args.keys, options=liferaft.LoadOptions(allow_pickle=args.allow_pickle))
    rows = [(key, *_describe(v)) for key, v in _leaves(tree, leaf_keys)]
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


