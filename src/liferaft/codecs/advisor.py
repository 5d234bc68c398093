"""``compression="auto"``: whether a save tries the lossless codec, as a pure function of what the caller states.

The decision depends only on its arguments, never on what earlier saves of the process measured, so two identical
saves write the same bytes whatever ran before them (issue #15), and every rank of a save decides alike:

- remote storage (``Storage.remote``: an object store, where bytes cross a network and cost money): compress;
- local storage whose write throughput the caller states (``SaveOptions.storage_write_bps``, e.g. measured by
  the caller on its earlier raw saves: ``SaveResult.bytes_written / SaveResult.timings["write"]``): compress
  when the codec threads together encode at least that fast (``threads`` × ``ENCODE_BPS``), i.e. when encoding
  keeps up with the disk;
- local storage otherwise: raw. (Measured: on the reference 2-core VM, 1 codec thread encodes ~0.5 GB/s and the
  disk writes ~2.5 GB/s, so a compressed local save is 3–5× slower; README "Limits".)

Either way the writer keeps a chunk encoded only where its first block shrinks below ``frames.PAYS_RATIO``
(deterministic too: a function of the chunk's bytes).
"""

from __future__ import annotations

#: Encoding throughput of ``bytegroup-zstd`` per codec thread, bytes of input per second: the low end of
#: ``benchmarks/bench_codec.py`` on trained weights and AdamW moments (459–1188 MB/s per core, reference VM).
ENCODE_BPS = 500e6


def should_compress(remote: bool, storage_write_bps: float | None, threads: int) -> bool:
    """The "auto" decision for a save to remote (object store) or local storage, given the storage's stated
    write throughput in bytes/s (None: unknown) and the number of codec threads."""
    if remote:
        return True
    if storage_write_bps is None:
        return False
    return threads * ENCODE_BPS >= storage_write_bps
