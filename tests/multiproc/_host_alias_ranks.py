"""Rank functions of test_host_sharing_records.py (importable by the spawned ranks)."""

from __future__ import annotations

import os

import torch

import liferaft
from liferaft import LiferaftError, LoadOptions

N = 1 << 20


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (low mantissa bits zero: it compresses) and ``w``."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, generator=g).view(torch.int32) & ~0xFFFF).view(torch.float32)
    return x, torch.randn(N, generator=g)


def load(rank: int, world: int, path: str, share: bool) -> dict | str:
    """Load w, x, y; the error's class name, or what y came out as and the bytes received from peers."""
    x, w = tensors()
    st = {k: torch.zeros(N) for k in ("w", "x", "y")}
    try:
        r = liferaft.load(path, st, options=LoadOptions(timeout=30, share_reads=share))
    except LiferaftError as e:
        return type(e).__name__
    xi, wi, yi = x.view(torch.int32), w.view(torch.int32), st["y"].view(torch.int32)
    return {"received": r.bytes_received, "x": torch.equal(st["x"].view(torch.int32), xi),
            "w": torch.equal(st["w"].view(torch.int32), wi), "y==x^w": torch.equal(yi, xi ^ wi),
            "y==x": torch.equal(yi, xi)}


def load_in_small_shm(rank: int, world: int, path: str, shm_dir: str, max_read: int) -> dict:
    """Load ``path`` (saved by ``multiproc._host_share_ranks.save`` as S0) into Shard(1) with same-host sharing,
    the segments in ``shm_dir`` (a small tmpfs); what came out and the warnings."""
    import warnings

    from multiproc import _host_share_ranks as R

    from liferaft.core.chunks import shm

    shm.SHM_DIR = shm_dir                   # (the seam: segments go to the small tmpfs)
    state = R.build(world, "S1", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = liferaft.load(path, state, options=LoadOptions(timeout=30, share_reads=True, max_read_bytes=max_read))
    right = all(torch.equal(state[k].full_tensor().view(torch.int32), R.reference(k).view(torch.int32))
                for k in R.SHAPES)
    return {"right": right, "received": res.bytes_received, "left": sorted(os.listdir(shm_dir)),
            "warned": [str(w.message) for w in caught if "shared reads are off" in str(w.message)]}


def load_with_odd_shm(rank: int, world: int, path: str, case: str, share: bool | None, private: str) -> dict:
    """Load ``path`` (``multiproc._host_share_ranks.save``, S0) into Shard(1) where the shared-memory set-up cannot
    work as planned: "separate" (rank 1 has a /dev/shm of its own, ``private``: another container of the same
    host name), "private" (the same, and the ranks take themselves for one host: a peer's segment cannot be
    opened), "exists" (rank 0 cannot make its segment: its name is taken). What came out and the warnings."""
    import tempfile
    import warnings

    from multiproc import _host_share_ranks as R

    from liferaft.core.chunks import shm

    if rank == 1 and case in ("separate", "private"):
        shm.SHM_DIR = tempfile.mkdtemp(dir=private)             # (the seam: rank 1's own shared-memory folder)
    if case == "private":
        shm.host_key = lambda: "one-host"                       # (the seam: the ranks cannot tell they differ)
    taken = ""
    if case == "exists" and rank == 0:
        taken = shm.new_name(0)
        open(os.path.join(shm.SHM_DIR, taken), "wb").close()
        shm.new_name = lambda r: taken                          # (the seam: a name another load holds)
    state = R.build(world, "S1", False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = liferaft.load(path, state, options=LoadOptions(timeout=30, share_reads=share))
    finally:
        if taken:
            os.unlink(os.path.join(shm.SHM_DIR, taken))
    right = all(torch.equal(state[k].full_tensor().view(torch.int32), R.reference(k).view(torch.int32))
                for k in R.SHAPES)
    left = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"liferaft-load-{os.getpid()}-")]
    return {"right": right, "received": res.bytes_received, "left": left,
            "warned": [str(w.message) for w in caught if "shared reads are off" in str(w.message)]}
