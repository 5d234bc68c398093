"""Conversion time and memory: liferaft ↔ Hugging Face safetensors, ↔ PyTorch DCP and ↔ torch.save on a
``--size-gib`` state, next to the ``safetensors`` package and DCP's own converters on the same tensors.

Each operation runs in a fresh process; peak memory is sampled every 10 ms as RSS and as anonymous memory
(RssAnon: what the process itself needs; memory-mapped file pages are page cache, counted in RSS but reclaimable).
Rows: liferaft's streamed conversions in both directions for each format; ``safetensors.torch.load_file`` +
``save_file`` (the package's own path, whole state in memory); DCP's ``dcp_to_torch_save`` and
``torch_save_to_dcp``; ``dcp.save`` of the state read whole (what a conversion without streaming does). Every
liferaft round trip is checked bit-exact with ``liferaft diff``. Markdown on stdout.
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

    from liferaft.tools import convert

    if kind.startswith("liferaft: "):                  # "liferaft: FROM → TO"
        src, to = kind.removeprefix("liferaft: ").split(" → ")
        return _measure(convert.convert, a, b, {"HF safetensors": "safetensors", "DCP": "dcp",
                                                "torch.save": "torch", "liferaft": "liferaft"}[to])
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
    if kind == "torch.save → DCP (torch_save_to_dcp)":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        return _measure(torch_save_to_dcp, a, b)
    if kind == "liferaft.read + dcp.save (not streamed)":
        import torch.distributed.checkpoint as dcp

        import liferaft

        return _measure(lambda: dcp.save(liferaft.read(a), storage_writer=dcp.FileSystemWriter(b), no_dist=True))
    if kind == "check":
        from liferaft.tools.diff import diff

        return {"identical": float(diff(a, b).identical)}
    raise ValueError(kind)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="liferaft-bench-convert-", dir=os.environ.get("BENCH_TMP"))
    rows = []
    try:
        src = os.path.join(tmp, "ck")
        run_solo(make_state, src, int(args.size_gib * 2**30))
        for fmt, name in (("HF safetensors", "hf"), ("DCP", "dcp"), ("torch.save", "m.pt")):
            out, back = os.path.join(tmp, name), os.path.join(tmp, "back")
            rows.append((f"liferaft: liferaft → {fmt}", run_solo(op, f"liferaft: liferaft → {fmt}", src, out)))
            rows.append((f"liferaft: {fmt} → liferaft", run_solo(op, f"liferaft: {fmt} → liferaft", out, back)))
            assert run_solo(op, "check", src, back)["identical"] == 1.0, f"the {fmt} round trip is not exact"
            shutil.rmtree(back, ignore_errors=True)
        for kind, a, b in (("safetensors package: load_file + save_file", "hf", "hf2"),
                           ("DCP → torch.save (dcp_to_torch_save)", "dcp", "state.pt"),
                           ("torch.save → DCP (torch_save_to_dcp)", "m.pt", "dcp2"),
                           ("liferaft.read + dcp.save (not streamed)", "ck", "dcp3")):
            rows.append((kind, run_solo(op, kind, os.path.join(tmp, a) if a != "ck" else src, os.path.join(tmp, b))))
            _remove(os.path.join(tmp, b))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = int(args.size_gib * 2**30) // (64 << 20) * (64 << 20)
    print(f"### Conversions, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"State: {size / 2**30:.1f} GiB of fp32 tensors (64 MiB each); each operation in a fresh process; the "
          "liferaft round trips checked bit-exact; DCP and torch.save written by liferaft are the files its imports "
          "read.\n")
    print("| operation | seconds | GB/s | peak extra RSS (MiB) | peak extra anonymous memory (MiB) |")
    print("|---|---|---|---|---|")
    for kind, r in rows:
        print(f"| {kind} | {r['seconds']:.2f} | {size / r['seconds'] / 1e9:.2f} | {r['rss']:.0f} | {r['anon']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
