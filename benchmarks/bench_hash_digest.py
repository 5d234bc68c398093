"""What the writer's hashing costs per GiB: block CRC-32C alone vs with the 64-bit chunk digest (docs/FORMAT.md
§3.1), the digest fed per piece after the CRCs (two passes over memory) or block by block right after each
block's CRC (``BlockHasher`` today: one pass, the block still in cache; the GIL-holding xxh3 held one block at a
time between GIL-free CRCs).

Same 1 GiB of float32, 16 MiB chunks fed in 8 MiB pieces (the writer's staging pieces), the three variants
interleaved ``--reps`` times; CPU seconds of the hashing thread (``time.thread_time``: a loaded machine moves wall
time, not this), median. Prints the markdown table for the README.

    PYTHONPATH=src python benchmarks/bench_hash_digest.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from liferaft.codecs.checksum import BlockHasher, choose_block_size

PIECE = 8 << 20
CHUNK = 16 << 20


class _TwoPass(BlockHasher):
    """The digest of each whole piece first, then the block CRCs (the same results, two passes)."""

    def update(self, data: memoryview) -> None:
        whole, self._whole = self._whole, None
        assert whole is not None
        whole.update(data)
        try:
            super().update(data)
        finally:
            self._whole = whole


VARIANTS = {
    "block CRC-32C only (no digest)": lambda bs: BlockHasher(bs),
    "CRC-32C + digest, two passes": lambda bs: _TwoPass(bs, whole=True),
    "CRC-32C + digest, one pass (BlockHasher)": lambda bs: BlockHasher(bs, whole=True),
}


def cpu_per_gib(make, mv: memoryview) -> float:
    t0 = time.thread_time()
    bs = choose_block_size(CHUNK)
    for c in range(0, len(mv), CHUNK):
        h = make(bs)
        for p in range(c, c + CHUNK, PIECE):
            h.update(mv[p:p + PIECE])
        h.finish()
        h.digest()
    return (time.thread_time() - t0) / (len(mv) / 2**30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0)
    a = ap.parse_args()
    n = int(a.gib * 2**30) // CHUNK * CHUNK
    mv = memoryview(torch.randn(n // 4).numpy()).cast("B")
    got: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(a.reps):
        for k in (VARIANTS if r % 2 == 0 else reversed(list(VARIANTS))):
            got[k].append(cpu_per_gib(VARIANTS[k], mv))
    base = statistics.median(got["block CRC-32C only (no digest)"])
    print(f"| hashing, {a.gib:g} GiB in 16 MiB chunks, 8 MiB pieces, {a.reps} interleaved reps | CPU s/GiB (median) "
          "| ÷ CRC only |")
    print("|---|---|---|")
    for k, v in got.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.3f} | {m / base:.2f}× |")


if __name__ == "__main__":
    main()
