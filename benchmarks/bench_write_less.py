"""Bytes written and save time per checkpoint: liferaft incremental / compressed saves vs full ones and vs DCP.

One process. A GPT-style model (``_models.py``, AdamW) is trained in three regimes: full training, fine-tuning
with ~90 % of the parameters frozen, LoRA (rank-8 adapters, base frozen). After each of ``--ckpts`` rounds of
``--steps`` training steps the same state (``get_state_dict``: FQN-keyed model + optimizer) is saved by every
method, each to its own folder:

- liferaft full: a self-contained checkpoint, no compression (what ``compression="auto"`` does on this disk);
- liferaft incremental: ``incremental_base`` = the method's previous checkpoint (what CheckpointManager does);
- liferaft incr + zstd: the same with ``compression="on"``;
- liferaft incr + zstd + xor: also ``delta=("*",)``: changed chunks stored as the XOR with the base's bytes;
- liferaft incr + q8 moments: also ``quantize`` Adam's exp_avg / exp_avg_sq (lossy, opt-in; max error printed);
- DCP: ``dcp.save`` with FileSystemWriter; DCP + zstd: with its ZStandard stream extension.

Bytes written: the files a checkpoint adds (a reference costs nothing). Time: the save call, durable on return
(both fsync). Round 0 is every method's first (full) checkpoint and is not counted. The newest checkpoint of each
method is then loaded into a fresh state after dropping the page cache (load seconds, checked bit-exact against
the saved state except for the lossy method). Prints markdown tables; JSON lines in ``bench-out/bench_write_less.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import ROOT, append_jsonl, dir_bytes, drop_cache, machine  # sets up the paths

import _models as M  # noqa: E402
import torch  # noqa: E402

METHODS = ("liferaft full", "liferaft incremental", "liferaft incr + zstd", "liferaft incr + zstd + xor",
           "liferaft incr + q8 moments", "DCP", "DCP + zstd")


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


def save(method: str, path: str, prev: str | None, st: dict[str, Any]) -> float:
    import liferaft
    import torch.distributed.checkpoint as dcp
    from liferaft import SaveOptions

    t0 = time.perf_counter()
    if method.startswith("DCP"):
        ext = []
        if method == "DCP + zstd":
            from torch.distributed.checkpoint._extension import ZStandard

            ext = [ZStandard()]
        dcp.save(st, storage_writer=dcp.FileSystemWriter(path, _extensions=ext or None))
    else:
        base = None if method == "liferaft full" or prev is None else os.path.basename(prev)
        opts = SaveOptions(compression="on" if "zstd" in method or "q8" in method else "off", incremental_base=base,
                           quantize=("optim.state.*.exp_avg*",) if "q8" in method else (),
                           delta=("*",) if "xor" in method else ())
        liferaft.save(path, st, options=opts)
    return time.perf_counter() - t0


def load(method: str, path: str, like: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    import liferaft
    import torch.distributed.checkpoint as dcp

    target = _clone(like)
    drop_cache(path)
    t0 = time.perf_counter()
    if method.startswith("DCP"):
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    else:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # the lossy method warns, by design
            liferaft.load(path, target)
    return time.perf_counter() - t0, target


def run_regime(regime: str, args: argparse.Namespace, tmp: str, jsonl: str, run_id: str) -> list[dict[str, Any]]:
    model, opt, step = M.build(regime, args.size)
    frozen_p, frozen_b = M.frozen_share(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"{regime}: {params / 1e6:.1f} M parameters, {frozen_p:.0%} frozen ({frozen_b:.0%} of the checkpoint's "
          f"tensor bytes)\n", flush=True)
    prev: dict[str, str | None] = {m: None for m in METHODS}
    rows = []
    n = 0
    for k in range(args.ckpts):
        for _ in range(args.steps):
            step(n)
            n += 1
        st = M.state(model, opt)
        for method in METHODS:
            path = os.path.join(tmp, regime, method.replace(" ", "_").replace("+", "p"), f"ck{k}")
            seconds = save(method, path, prev[method], st)
            row = {"run": run_id, "regime": regime, "method": method, "ckpt": k, "seconds": seconds,
                   "bytes": dir_bytes(path), "state_bytes": sum(t.numel() * t.element_size()
                                                                for t in _tensors(st).values())}
            rows.append(row)
            append_jsonl(jsonl, row)
            old = prev[method]
            if old is not None and (method.startswith("DCP") or method == "liferaft full"):
                shutil.rmtree(old)               # (incremental ones may be referenced: kept)
            prev[method] = path
    want = _tensors(st)
    for method in METHODS:
        assert prev[method] is not None
        seconds, got = load(method, prev[method], st)
        got_t = _tensors(got)
        if "q8" in method:
            err = max(float((got_t[k] - want[k]).abs().max()) for k in want if "exp_avg" in k)
            ok = all(torch.equal(got_t[k], want[k]) for k in want if "exp_avg" not in k)
        else:
            err, ok = 0.0, all(torch.equal(got_t[k], want[k]) for k in want)
        if not ok:
            raise AssertionError(f"{method}: the loaded state differs from the saved one")
        row = {"run": run_id, "regime": regime, "method": method, "op": "load", "seconds": seconds, "max_error": err}
        rows.append(row)
        append_jsonl(jsonl, row)
    return rows


def report(regime: str, rows: list[dict[str, Any]]) -> str:
    saves = [r for r in rows if r.get("op") != "load" and r["ckpt"] > 0]
    loads = {r["method"]: r for r in rows if r.get("op") == "load"}

    def med(method: str, field: str) -> float:
        return statistics.median(r[field] for r in saves if r["method"] == method)

    full_b, dcp_b, dcp_s = med("liferaft full", "bytes"), med("DCP", "bytes"), med("DCP", "seconds")
    lines = [f"| {regime}: method | bytes / ckpt (MB) | of full | of DCP | save s | DCP ÷ this (time) | load s | "
             "lossy max error |", "|---|---|---|---|---|---|---|---|"]
    for m in METHODS:
        b, s = med(m, "bytes"), med(m, "seconds")
        lines.append(f"| {m} | {b / 1e6:.1f} | {b / full_b:.1%} | {b / dcp_b:.1%} | {s:.3f} | {dcp_s / s:.2f} | "
                     f"{loads[m]['seconds']:.3f} | {loads[m]['max_error']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=list(M.SIZES), default="small")
    ap.add_argument("--ckpts", type=int, default=4, help="checkpoints per regime (the first is not counted)")
    ap.add_argument("--steps", type=int, default=2, help="training steps between checkpoints")
    ap.add_argument("--regimes", default="full,frozen90,lora")
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 checkpoints (CI smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.ckpts, args.steps = "quick", 3, 1
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    jsonl = os.path.join(ROOT, "bench-out", "bench_write_less.jsonl")
    os.makedirs(os.path.dirname(jsonl), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="liferaft-bench-wl-", dir=os.environ.get("BENCH_TMP"))
    t0 = time.perf_counter()
    try:
        print(f"# write less — {datetime.date.today()}, {machine()}, model size {args.size}, {args.ckpts} "
              f"checkpoints × {args.steps} steps\n")
        for regime in args.regimes.split(","):
            rows = run_regime(regime, args, tmp, jsonl, run_id)
            print(report(regime, rows) + "\n", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"(took {time.perf_counter() - t0:.0f} s; raw data in {jsonl})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
