"""``liferaft diff`` and ``liferaft convert``: two checkpoints of any formats (docs/cli/diff.md,
docs/cli/convert.md)."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import liferaft
from liferaft.cli.args import RenamePair, number
from liferaft.cli.progress import FolderGrowth, Progress
from liferaft.errors import OptionsError
from liferaft.storage import walk

FORMATS = ["liferaft", "safetensors", "hf", "torch", "dcp"]


def add_parsers(sub: Any) -> None:
    """Add ``diff`` and ``convert`` to the subcommands ``sub``."""
    p = sub.add_parser("diff", help="compare two checkpoints key by key (exit status 1 if they differ); either "
                       "may also be a safetensors folder/file, a DCP folder or a torch.save file")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="GLOB", help="only keys matching; repeatable")
    p.add_argument("--tolerance", type=number(0), default=0.0, help="max abs difference still counted as equal")
    p.add_argument("--rename", nargs=2, action=RenamePair, metavar=("REGEX", "REPLACEMENT"),
                   help="rename B's keys to A's names before comparing (applied in order); repeatable")
    p.add_argument("--module", metavar="KEY", help="compare A's subtree KEY with all of B (an hf export of that "
                   "module): A's keys under KEY, B's keys read as KEY.<key>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_diff)

    p = sub.add_parser("convert", help="convert between liferaft, safetensors, torch.save and DCP, or export a "
                       "model as a Hugging Face folder (--to hf)")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", required=True, choices=FORMATS,
                   help="hf: a folder from_pretrained loads (one module's weights, its config); safetensors: "
                   "every tensor under its full key")
    p.add_argument("--from", dest="source", choices=FORMATS,
                   help="format of SRC (default: guessed from what is there; hf = safetensors)")
    p.add_argument("--module", metavar="KEY", help="--to hf: the subtree that is the model (default: the one "
                   "saved as an nn.Module; needed when there are several; '' for every tensor)")
    p.add_argument("--config", metavar="PATH", help="--to hf: a config.json, or a model folder whose config and "
                   "tokenizer files are copied (default: those recorded when SRC was imported from one)")
    p.add_argument("--max-shard-size", type=number(1e-6, 1e6), default=5.0, help="GB per safetensors shard (default 5)")
    p.add_argument("--dtype", help="cast floating-point tensors on export (e.g. bfloat16)")
    p.add_argument("--key", "-k", dest="keys", action="append", metavar="GLOB", help="only keys matching; repeatable")
    p.add_argument("--rename", nargs=2, action=RenamePair, metavar=("REGEX", "REPLACEMENT"),
                   help="rename keys by regex (applied in order); repeatable")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_convert)


def _tree_bytes(path: str) -> int:
    """Bytes of the local file ``path``, or of the files under the local folder ``path``."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in walk(path) for f in fs)


def run_convert(args: argparse.Namespace) -> int:
    """Convert SRC to DST (an export streams with a bar of the bytes read, an import with the files written)."""
    fmt = args.source or liferaft.format_of(args.src)
    src = {"hf": "safetensors"}.get(fmt, fmt)
    to = args.to
    hf = {"module": args.module, "config": args.config}
    rename = _renames(args.rename)
    if src == "liferaft":
        tensors = liferaft.inspect(args.src).tensors
        if to == "hf":                                     # the bar counts the model's bytes only
            prefix = liferaft.find_model(args.src, args.module)
            tensors = tuple(t for t in tensors if t.kind == "tensor" and (not prefix or t.key.startswith(prefix + ".")))
        total = sum(t.nbytes for t in tensors)
    else:                                                  # an import: the bar follows the files written
        total = _tree_bytes(args.src)
    with Progress(total, "export" if src == "liferaft" else "import", None if not args.json else False) as tick:
        if src == "liferaft":
            r = liferaft.convert(args.src, args.dst, to, source=src, keys=args.keys, dtype=args.dtype, rename=rename,
                                 max_shard_bytes=int(args.max_shard_size * 1e9), progress=tick, **hf)
        else:
            with FolderGrowth(args.dst, tick):
                r = liferaft.convert(args.src, args.dst, to, source=src, keys=args.keys, dtype=args.dtype,
                                     rename=rename, max_shard_bytes=int(args.max_shard_size * 1e9), **hf)
    if args.json:
        print(json.dumps({"from": src, "to": to, "files": list(r.files), "tensors": r.tensors, "bytes": r.bytes}
                         | ({"module": r.module, "notes": list(r.notes)} if to == "hf" else {})))
    else:
        print(f"{src} → {to}: {args.dst} ({r.tensors} tensor(s), {len(r.files)} file(s), {r.bytes / 2**20:.1f} MiB)")
        for note in r.notes:
            print(f"  {note}")
    return 0


def _renames(pairs: list[list[str]] | None) -> list[tuple[str, str]]:
    """``--rename REGEX REPLACEMENT`` pairs, each checked (OptionsError naming the pair: one error line)."""
    out = []
    for a, b in pairs or []:
        try:
            re.compile(a).sub(b, "")
        except (re.error, RecursionError, OverflowError, IndexError) as e:
            raise OptionsError(f"--rename {a!r} {b!r}: not a valid regular expression and replacement: {e}") \
                from None
        out.append((a, b))
    return out


def run_diff(args: argparse.Namespace) -> int:
    """Print the keys that differ and a summary line (or JSON); exit status 1 when the checkpoints differ."""
    rename = _renames(args.rename)
    def total() -> int:
        return sum(t.nbytes for t in liferaft.inspect(args.a).tensors if not args.module or
                   t.key.startswith(args.module + ".")) if liferaft.format_of(args.a) == "liferaft" else 0

    with Progress(total, "diff", None if not args.json else False) as tick:
        r = liferaft.diff(args.a, args.b, keys=args.keys, tolerance=args.tolerance, progress=tick,
                          rename=rename, module=args.module)
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
