"""Bytes written and save time per checkpoint: liferaft incremental / compressed saves vs full ones and vs DCP.

One process. A GPT-style model (``_models.py``, AdamW) is trained in four regimes: full training, "crumbs" (full
training but for two small parameters without gradient: 0.2 % of the bytes never change), fine-tuning with ~90 %
of the parameters frozen, LoRA (rank-8 adapters, base frozen). After each of ``--ckpts`` rounds of
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
the saved state except for the lossy method).

Bytes on disk vs ``keep_last`` (``--mgr-saves`` saves through ``CheckpointManager(keep_last=2)``, ``full_every=10``
per regime, the same states into three roots): "always reference" (``reference_min_share=0``: every unchanged
chunk is referenced, however few, which keeps the older step it lives in), "default" (a step that would give
less than 10 % of the save's bytes is not referenced; its chunks are copied) and "every save full"
(``SavePolicy(full_every=1)``). After each save, once retention has run: the bytes the step added, the steps and bytes on
disk. The newest step of each root is restored and checked bit-exact.

The threshold sweep (``--sweep``): a synthetic state of 256 tensors of which a chosen share never changes, saved
the same way with the share of unchanged bytes from 0.4 % to 90 %, each step referencing (``reference_min_share=0``)
or copying (``=1``) them: what referencing saves in writes per save against what it costs in disk.

Prints markdown tables; JSON lines in ``bench-out/bench_write_less.jsonl``.
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

import _models as M
import torch
from _common import ROOT, append_jsonl, dir_bytes, drop_cache, machine  # sets up the paths

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
    import torch.distributed.checkpoint as dcp

    import liferaft
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
    import torch.distributed.checkpoint as dcp

    import liferaft

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
    print(f"{regime}: {params / 1e6:.1f} M parameters, {frozen_p:.1%} frozen ({frozen_b:.1%} of the checkpoint's "
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


POLICIES = {"always reference": dict(save_options={"reference_min_share": 0.0}),
            "default (copy < 10 %)": dict(save_options={}),
            "every save full": dict(full_every=1, save_options={})}


def _manager(root: str, keep_last: int, policy: dict[str, Any]) -> Any:
    from liferaft import CheckpointManager, SaveOptions, SavePolicy

    opts = SaveOptions(compression="off", **policy.get("save_options", {}))
    return CheckpointManager(root, every_steps=1, keep_last=keep_last, async_save=False,
                             save_policy=SavePolicy(full_every=policy.get("full_every", 10)), save_options=opts)


def _settled(mgr: Any) -> None:
    """Wait for the manager's retention pass (it runs on one background worker after each save)."""
    if mgr._deleter is not None:                    # private: a benchmark may look inside
        mgr._deleter.submit(lambda: None).result()


def _on_disk(root: str) -> tuple[int, int]:
    """(steps, bytes) under a manager root."""
    steps = [d for d in os.listdir(root) if d.startswith("step-")]
    return len(steps), sum(dir_bytes(os.path.join(root, d)) for d in steps)


def _managed_saves(label: str, mgrs: dict[str, Any], roots: dict[str, str], k: int, st: Any, full_bytes: int,
                   jsonl: str, run_id: str) -> list[dict[str, Any]]:
    rows = []
    for policy, mgr in mgrs.items():
        t0 = time.perf_counter()
        mgr.maybe_save(k, st)
        seconds = time.perf_counter() - t0
        _settled(mgr)
        steps, disk = _on_disk(roots[policy])
        own = dir_bytes(os.path.join(roots[policy], f"step-{k:010d}"))
        row = {"run": run_id, "table": "retention", "regime": label, "policy": policy, "save": k,
               "seconds": seconds, "written": own, "steps_on_disk": steps, "disk": disk, "full_bytes": full_bytes}
        rows.append(row)
        append_jsonl(jsonl, row)
    return rows


def _restore_exact(mgrs: dict[str, Any], st: Any) -> None:
    want = _tensors(st)
    for policy, mgr in mgrs.items():
        got = _clone(st)
        mgr.restore(got)
        if not all(torch.equal(v, want[k]) for k, v in _tensors(got).items()):
            raise AssertionError(f"{policy}: the restored state differs from the saved one")
        mgr.close()


def run_retention(regime: str, args: argparse.Namespace, tmp: str, jsonl: str, run_id: str) -> list[dict[str, Any]]:
    model, opt, step = M.build(regime, args.size)
    roots = {p: os.path.join(tmp, "mgr", regime, str(i)) for i, p in enumerate(POLICIES)}
    mgrs = {p: _manager(roots[p], args.keep_last, POLICIES[p]) for p in POLICIES}
    rows, n = [], 0
    for k in range(args.mgr_saves):
        for _ in range(args.steps):
            step(n)
            n += 1
        st = M.state(model, opt)
        full = sum(t.numel() * t.element_size() for t in _tensors(st).values())
        rows += _managed_saves(regime, mgrs, roots, k, st, full, jsonl, run_id)
    _restore_exact(mgrs, st)
    return rows


def run_sweep(args: argparse.Namespace, tmp: str, jsonl: str, run_id: str) -> list[dict[str, Any]]:
    """Synthetic state: ``n`` tensors, the first ``frozen`` never change, the others change at every save."""
    n, numel = (64, 16384) if args.quick else (256, 65536)           # 4 MiB / 64 MiB of float32
    policies = {"reference": {"save_options": {"reference_min_share": 0.0}},
                "copy": {"save_options": {"reference_min_share": 1.0}}, "full": {"full_every": 1}}
    rows = []
    for frozen in sorted({max(1, round(n * u)) for u in args.sweep}):
        label = f"{frozen / n:.1%}"
        g = torch.Generator().manual_seed(frozen)
        st = {f"t{i:03d}": torch.randn(numel, generator=g) for i in range(n)}
        roots = {p: os.path.join(tmp, "sweep", label, p) for p in policies}
        mgrs = {p: _manager(roots[p], args.keep_last, policies[p]) for p in policies}
        for k in range(args.mgr_saves):
            for i in range(frozen, n):
                st[f"t{i:03d}"].add_(1e-3)
            rows += _managed_saves(label, mgrs, roots, k, st, n * numel * 4, jsonl, run_id)
        _restore_exact(mgrs, st)
    return rows


def report_retention(regime: str, rows: list[dict[str, Any]], keep_last: int) -> str:
    """Per policy: bytes written per save, save time, and (after retention) steps and bytes on disk."""
    mine = [r for r in rows if r["regime"] == regime]
    full = mine[-1]["full_bytes"]
    lines = [f"| {regime}: keep_last={keep_last} | written / save (MB) | save s | steps on disk: median, max | "
             f"on disk: median, max (MB) | median ÷ (keep_last × state) |", "|---|---|---|---|---|---|"]
    for p in POLICIES:
        r = [x for x in mine if x["policy"] == p]
        later = r[1:]
        disk = [x["disk"] for x in r]
        lines.append(f"| {p} | {statistics.median(x['written'] for x in later) / 1e6:.1f} | "
                     f"{statistics.median(x['seconds'] for x in later):.3f} | "
                     f"{statistics.median(x['steps_on_disk'] for x in r):.0f}, {max(x['steps_on_disk'] for x in r)} | "
                     f"{statistics.median(disk) / 1e6:.1f}, {max(disk) / 1e6:.1f} | "
                     f"{statistics.median(disk) / (keep_last * full):.2f} |")
    return "\n".join(lines)


def report_sweep(rows: list[dict[str, Any]], keep_last: int) -> str:
    """Per share of unchanged bytes: written per save and bytes on disk (median over the saves, in units of the
    state), referencing vs copying the unchanged chunks, and the save times (with every save full for scale)."""
    lines = ["| unchanged share | written / save: reference, copy | on disk, median: reference, copy | "
             "on disk, max: reference, copy | save s: reference, copy, full |", "|---|---|---|---|---|"]
    full = 0
    for label in dict.fromkeys(r["regime"] for r in rows):
        r = {p: [x for x in rows if x["regime"] == label and x["policy"] == p] for p in ("reference", "copy", "full")}
        full = r["full"][0]["full_bytes"]

        def written(p: str) -> str:
            return f"{statistics.median(x['written'] for x in r[p][1:]) / full:.1%}"

        def disk(p: str, how: Any) -> str:
            return f"{how(x['disk'] for x in r[p]) / full:.2f}×"

        def sec(p: str) -> str:
            return f"{statistics.median(x['seconds'] for x in r[p][1:]):.3f}"

        lines.append(f"| {label} | {written('reference')}, {written('copy')} | {disk('reference', statistics.median)}, "
                     f"{disk('copy', statistics.median)} | {disk('reference', max)}, {disk('copy', max)} | "
                     f"{sec('reference')}, {sec('copy')}, {sec('full')} |")
    return f"(state {full / 2**20:.0f} MiB; bytes in units of the state's)\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=list(M.SIZES), default="small")
    ap.add_argument("--ckpts", type=int, default=4, help="checkpoints per regime (the first is not counted)")
    ap.add_argument("--steps", type=int, default=2, help="training steps between checkpoints")
    ap.add_argument("--regimes", default="full,crumbs,frozen90,lora")
    ap.add_argument("--keep-last", type=int, default=2, help="CheckpointManager's keep_last for the disk tables")
    ap.add_argument("--mgr-saves", type=int, default=12, help="saves per regime through CheckpointManager")
    ap.add_argument("--sweep", default="0.004,0.01,0.03,0.05,0.1,0.2,0.3,0.5,0.9",
                    help="shares of unchanged bytes for the threshold sweep ('' to skip)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 checkpoints (CI smoke run)")
    args = ap.parse_args(argv)
    args.sweep = [float(x) for x in args.sweep.split(",") if x]
    if args.quick:
        args.size, args.ckpts, args.steps, args.mgr_saves = "quick", 3, 1, 4
        args.sweep = [0.01, 0.5]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    jsonl = os.path.join(ROOT, "bench-out", "bench_write_less.jsonl")
    os.makedirs(os.path.dirname(jsonl), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="liferaft-bench-wl-", dir=os.environ.get("BENCH_TMP"))
    t0 = time.perf_counter()
    try:
        print(f"# write less — {datetime.date.today()}, {machine()}, model size {args.size}, {args.ckpts} "
              f"checkpoints × {args.steps} steps\n")
        regimes = args.regimes.split(",")
        for regime in regimes:
            rows = run_regime(regime, args, tmp, jsonl, run_id)
            print(report(regime, rows) + "\n", flush=True)
        print(f"## Bytes on disk vs keep_last ({args.mgr_saves} saves, {args.steps} steps apart, full_every=10)\n")
        for regime in regimes:
            rows = run_retention(regime, args, tmp, jsonl, run_id)
            print(report_retention(regime, rows, args.keep_last) + "\n", flush=True)
        if args.sweep:
            print(f"## Threshold sweep: reference or copy the unchanged chunks (keep_last={args.keep_last})\n")
            print(report_sweep(run_sweep(args, tmp, jsonl, run_id), args.keep_last) + "\n", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"(took {time.perf_counter() - t0:.0f} s; raw data in {jsonl})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
