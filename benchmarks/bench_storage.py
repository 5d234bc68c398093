"""Save/load throughput to an S3-compatible server next to the local disk, and the cost of checksums on load.

Same state as ``bench_sync.py`` (GPT-like fp32 params + Adam moments), one process. Per rep, each in a fresh
process: ``liferaft.save`` / ``liferaft.load`` (in place) to a local folder (load after fadvise(DONTNEED)) and to
``s3://bucket/prefix`` on a moto S3 server started here (a subprocess on 127.0.0.1, HTTP; moto is pure Python,
so its own CPU time bounds these numbers — they show the backend works at a sane rate and what it costs next to
the disk, not what a real object store sustains); DCP to the local folder as the reference. S3 is measured with
compression off (the backend's own cost) and with the default "auto" (compressing for object stores): the
benchmark state is a synthetic index pattern that compresses far better than real weights (which store at
0.69–0.85 of raw, ``bench_codec.py``), so that row shows the mechanism, not a realistic ratio. The checksum share is
``timings["checksum"] / timings["read"]`` of the liferaft load: the seconds spent hashing, which run overlapped
with the reads; and the local load is timed once more with verification switched off in that benchmark process
(never a mode of liferaft), which gives what verification really adds. Output: a markdown table; JSON lines in
``bench-out/bench_storage.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time
from typing import Any

import _bench_ranks as W
from _common import ROOT, append_jsonl, drop_cache, machine, run_solo  # sets up the paths


def _save(target: str, cfg: W.Config, method: str) -> dict[str, Any]:
    state = W.build_state(cfg, "full", filled=True)
    t0 = time.perf_counter()
    stored = 0
    if method == "dcp":
        W.do_save("dcp", target, state, cfg, solo=True)
    else:
        import liferaft

        opts = liferaft.SaveOptions(compression="off" if method == "liferaft-raw" else "auto")
        stored = liferaft.save(target, state, options=opts).total_bytes
    return {"seconds": time.perf_counter() - t0, "stored": stored}


def _load(target: str, cfg: W.Config, method: str) -> dict[str, Any]:
    import liferaft

    targets = W.build_state(cfg, "full", filled=False)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if method == "dcp":
        W.do_load("dcp", target, targets, cfg, solo=True)
    else:
        timings = dict(liferaft.load(target, targets).timings)
    seconds = time.perf_counter() - t0
    W.verify(targets, cfg, f"{method} load of {target}")
    return {"seconds": seconds, "timings": timings}


def op(kind: str, target: str, cfg: W.Config, method: str, env: dict[str, str]) -> dict[str, Any]:
    """One timed save or load in this (fresh) process, with the S3 endpoint in its environment. Method
    "liferaft-nocheck" loads with block verification replaced by a no-op in this process: a measurement of
    what verifying costs, never a mode liferaft offers."""
    os.environ.update(env)
    if method == "liferaft-raw" and kind == "load":
        method = "liferaft"
    if method == "liferaft-nocheck":
        from liferaft.core.chunks import reader

        reader.verify_blocks = lambda *args: None      # this benchmark process only
        method = "liferaft"
    return _save(target, cfg, method) if kind == "save" else _load(target, cfg, method)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from liferaft.testing.s3server import MotoS3Server

    cfg = W.pick_config(args.size_gib)
    nbytes = cfg.nbytes()
    tmp = os.path.join(ROOT, "bench-out", "tmp", f"storage-{os.getpid()}")
    jsonl = os.path.join(ROOT, "bench-out", "bench_storage.jsonl")
    os.makedirs(tmp, exist_ok=True)
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    print(f"state: {nbytes / 1e9:.3f} GB", file=sys.stderr, flush=True)
    try:
        with MotoS3Server() as server:
            env = server.env()
            for rep in range(args.reps):
                targets = {"liferaft → local disk": ("liferaft", os.path.join(tmp, f"l{rep}")),
                           "liferaft → S3 (moto), compression off": ("liferaft-raw",
                                                                      f"s3://{server.bucket}/raw{rep}"),
                           "liferaft → S3 (moto), compression auto (on)": ("liferaft",
                                                                           f"s3://{server.bucket}/ck{rep}"),
                           "DCP → local disk": ("dcp", os.path.join(tmp, f"d{rep}"))}
                for label, (method, target) in targets.items():
                    kinds = [("save", method), ("load", method)]
                    if label == "liferaft → local disk":
                        kinds.append(("load", "liferaft-nocheck"))
                    for kind, m in kinds:
                        if kind == "load" and not target.startswith("s3://"):
                            drop_cache(target)
                        out = run_solo(op, kind, target, cfg, m, env)
                        key = kind if m == method else "load-nocheck"
                        samples.setdefault((label, key), []).append(out)
                        append_jsonl(jsonl, {"rep": rep, "target": label, "op": key, "bytes": nbytes, **out})
                        print(f"  rep {rep} {label:<24} {key} {out['seconds']:.3f} s", file=sys.stderr, flush=True)
                    if not target.startswith("s3://"):
                        shutil.rmtree(target, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"### Storage backends, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {nbytes / 1e9:.2f} GB, one process, {args.reps} reps, median seconds and GB/s; each op in a fresh "
          "process; local loads after fadvise(DONTNEED); every load verified bit-exact.\n")
    print("| target | save (s) | save GB/s | stored ÷ state | load (s) | load GB/s | hashing ÷ load time |")
    print("|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(k[0] for k in samples):
        s = statistics.median(x["seconds"] for x in samples[(label, "save")])
        loads = samples[(label, "load")]
        ld = statistics.median(x["seconds"] for x in loads)
        shares = [x["timings"]["checksum"] / x["timings"]["read"] for x in loads if x.get("timings")]
        share = f"{100 * statistics.median(shares):.1f} %" if shares else "–"
        stored = statistics.median(x.get("stored", 0) for x in samples[(label, "save")])
        ratio = f"{stored / nbytes:.3f}" if stored else "–"
        print(f"| {label} | {s:.2f} | {nbytes / s / 1e9:.2f} | {ratio} | {ld:.2f} | {nbytes / ld / 1e9:.2f} | {share} |")
    nocheck = samples.get(("liferaft → local disk", "load-nocheck"))
    if nocheck:
        with_check = [x["seconds"] for x in samples[("liferaft → local disk", "load")]]
        without = [x["seconds"] for x in nocheck]
        cost = statistics.median(with_check) / statistics.median(without) - 1
        print(f"\nChecksums on load (local disk): {statistics.median(with_check):.3f} s verified vs "
              f"{statistics.median(without):.3f} s with verification switched off in the benchmark process: "
              f"{100 * cost:+.1f} % (hashing runs overlapped with the reads).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
