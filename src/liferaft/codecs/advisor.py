"""``compression="auto"``: compress when it makes the save faster or the checkpoint smaller at no cost in time.

- Remote storage (an object store: bytes cross a network and cost money): always compress.
- Local storage: compress only when the codec keeps up with the disk, i.e. when the codec threads
  (``frames.threads()``) together encode at least as fast as this process last measured its raw writes
  (``record_write``). The codec's speed is
  measured once per process on a sample of the state (about 1 MiB: a few ms). Until a raw write has been
  measured, the first local save is written raw (and measures the disk).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

_LOCK = threading.Lock()
_CODEC_BPS: float | None = None         # bytes of input per second per codec thread
_DISK_BPS: float | None = None          # raw bytes per second of this process's last raw write
SAMPLE = 1 << 20


def record_write(nbytes: int, seconds: float) -> None:
    """Remember the throughput of a raw write of ``nbytes`` (only writes of at least 64 MiB count)."""
    global _DISK_BPS
    if nbytes >= 64 << 20 and seconds > 0:
        with _LOCK:
            _DISK_BPS = nbytes / seconds


def _codec_speed(tensors: Sequence[torch.Tensor]) -> float | None:
    from liferaft.codecs import bytegroup

    for t in tensors:
        if t.is_floating_point() and t.numel() * t.element_size() >= 64 << 10:
            flat = t.detach().reshape(-1)[: SAMPLE // t.element_size()].cpu().contiguous()
            data = memoryview(flat.view(torch.uint8).numpy())
            t0 = time.perf_counter()
            bytegroup.encode(data, t.element_size())
            return len(data) / max(time.perf_counter() - t0, 1e-9)
    return None


def should_compress(remote: bool, tensors: Sequence[torch.Tensor]) -> bool:
    """The "auto" decision for a save of ``tensors`` (this rank's chunks) to remote or local storage."""
    global _CODEC_BPS
    if remote:
        return True
    with _LOCK:
        disk, codec = _DISK_BPS, _CODEC_BPS
    if disk is None:
        return False
    if codec is None:
        codec = _codec_speed(tensors)
        if codec is None:
            return False
        with _LOCK:
            _CODEC_BPS = codec
    from liferaft.codecs.frames import threads

    return codec * threads() >= disk


def measured() -> dict[str, float | None]:
    """What the advisor has measured in this process (bytes/s): for benchmarks and tests."""
    with _LOCK:
        return {"codec_bps_per_thread": _CODEC_BPS, "disk_bps": _DISK_BPS}
