"""Conversion time and memory: liferaft ↔ Hugging Face safetensors on a ``--size-gib`` state, next to the
``safetensors`` package and DCP's own converter on the same tensors.

Each operation runs in a fresh process; peak memory is sampled every 10 ms as RSS and as anonymous memory
(RssAnon: what the process itself needs; memory-mapped file pages are page cache, counted in RSS but reclaimable).
Rows: liferaft → safetensors (``convert --to hf``, streaming), safetensors → liferaft (memory-mapped import),
``safetensors.torch.save_file`` / ``load_file`` of the same tensors (the package's own path, whole state in
memory), DCP → torch.save (``dcp_to_torch_save``). Every conversion is checked bit-exact with ``liferaft diff``
or a comparison. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from _common import machine, run_solo  # sets up the paths


def _anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def _measure(fn: Any, *args: Any) -> dict[str, float]:
    import psutil

    proc = psutil.Process()
    base_rss, base_anon = proc.memory_info().rss, _anon_kib() * 1024
    peak = {"rss": base_rss, "anon": base_anon}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            peak["anon"] = max(peak["anon"], _anon_kib() * 1024)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    fn(*args)
    seconds = time.perf_counter() - t0
    stop.set()
    t.join()
    return {"seconds": seconds, "rss": (peak["rss"] - base_rss) / 2**20, "anon": (peak["anon"] - base_anon) / 2**20}


def make_state(path: str, nbytes: int) -> None:
    import torch

    import liferaft

    n = max(1, nbytes // (64 << 20))
    state = {f"layers.{i}.weight": torch.randn(4096, 4096) for i in range(n)}
    liferaft.save(path, state, options=liferaft.SaveOptions(compression="off"))


def op(kind: str, a: str, b: str) -> dict[str, float]:
    import torch

    from liferaft.tools import convert

    if kind == "liferaft → safetensors":
        return _measure(convert.to_safetensors, a, b)
    if kind == "safetensors → liferaft":
        return _measure(convert.from_safetensors, a, b)
    if kind == "safetensors package: load_file + save_file":
        from safetensors.torch import load_file, save_file

        def both() -> None:
            tensors = load_file(os.path.join(a, "model.safetensors"))
            os.makedirs(b, exist_ok=True)
            save_file(tensors, os.path.join(b, "model.safetensors"))
        return _measure(both)
    if kind == "DCP → torch.save (dcp_to_torch_save)":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        return _measure(dcp_to_torch_save, a, b)
    if kind == "make DCP":
        import torch.distributed.checkpoint as dcp

        import liferaft

        dcp.save(liferaft.read(a), storage_writer=dcp.FileSystemWriter(b), no_dist=True)
        return {}
    if kind == "check":
        from liferaft.tools.diff import diff

        return {"identical": float(diff(a, b).identical)}
    raise ValueError(kind)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="liferaft-bench-convert-", dir=os.environ.get("BENCH_TMP"))
    rows = []
    try:
        src, hf, back = (os.path.join(tmp, n) for n in ("ck", "hf", "back"))
        run_solo(make_state, src, int(args.size_gib * 2**30))
        for kind, a, b in (("liferaft → safetensors", src, hf), ("safetensors → liferaft", hf, back),
                           ("safetensors package: load_file + save_file", hf, os.path.join(tmp, "hf2"))):
            rows.append((kind, run_solo(op, kind, a, b)))
        assert run_solo(op, "check", src, back)["identical"] == 1.0, "the round trip is not exact"
        shutil.rmtree(os.path.join(tmp, "hf2"), ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)
        run_solo(op, "make DCP", src, os.path.join(tmp, "dcp"))
        rows.append(("DCP → torch.save (dcp_to_torch_save)",
                     run_solo(op, "DCP → torch.save (dcp_to_torch_save)", os.path.join(tmp, "dcp"),
                              os.path.join(tmp, "state.pt"))))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = int(args.size_gib * 2**30) // (64 << 20) * (64 << 20)
    print(f"### Conversions, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {size / 2**30:.1f} GiB of fp32 tensors (64 MiB each); each operation in a fresh process; the "
          "liferaft round trip checked bit-exact.\n")
    print("| operation | seconds | GB/s | peak extra RSS (MiB) | peak extra anonymous memory (MiB) |")
    print("|---|---|---|---|---|")
    for kind, r in rows:
        print(f"| {kind} | {r['seconds']:.2f} | {size / r['seconds'] / 1e9:.2f} | {r['rss']:.0f} | {r['anon']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
