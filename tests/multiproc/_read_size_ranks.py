"""Rank bodies of test_read_size_ranks: ranks whose storages answer different read sizes load one checkpoint."""

from __future__ import annotations

import torch

import liferaft
from liferaft.options import LoadOptions, SaveOptions


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"a": torch.randn(2048, 1024, generator=g), "b": torch.randn(6144, 1024, generator=g),
            "s": torch.randn(64, 64, generator=g)}


def save_rows(rank: int, world: int, path: str, block_size: int | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    st = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in reference().items()}
    liferaft.save(path, st, options=SaveOptions(compression="off", block_size=block_size, chunk_bytes=128 << 20))


def load(rank: int, world: int, paths: list[str], reads: list[int | None], layout: str) -> tuple:
    """Load ``paths[rank]`` with ``max_read_bytes=reads[rank]`` into full tensors (``layout`` "full") or column
    shards ("cols"); (outcome, bit-exact, the error or the bytes received from peers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = reference()
    if layout == "full":
        st = {k: torch.zeros_like(v) for k, v in ref.items()}
    else:
        mesh = init_device_mesh("cpu", (world,))
        st = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in ref.items()}
    try:
        res = liferaft.load(paths[rank], st, options=LoadOptions(timeout=30, max_read_bytes=reads[rank]))
    except liferaft.LiferaftError as e:
        return ("error", False, f"{type(e).__name__}: {e}")
    got = {k: (v.full_tensor() if layout != "full" else v) for k, v in st.items()}
    return ("ok", all(torch.equal(got[k], ref[k]) for k in ref), res.bytes_received)


_WIDE = {"a": (4096, 2048), "b": (4096, 2048)}


def _wide(world: int, dim: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(torch.randn(s, generator=torch.Generator().manual_seed(ord(k))) if fill
                                 else torch.zeros(s), mesh, [Shard(dim)]) for k, s in _WIDE.items()}


def save_wide(rank: int, world: int, path: str) -> None:
    liferaft.save(path, _wide(world, 0, True), options=SaveOptions(compression="off"))


def load_wide_in(rank: int, world: int, path: str, shm_dir: str) -> dict:
    """Load ``save_wide``'s checkpoint as Shard(1) with the default read size, the host's shared reads in
    ``shm_dir``: whether right, the bytes received from the host's other ranks, the warnings about sharing."""
    import warnings

    from liferaft.core.chunks import shm

    shm.SHM_DIR = shm_dir
    st = _wide(world, 1, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = liferaft.load(path, st, options=LoadOptions(timeout=60, share_reads=True))
    right = all(torch.equal(st[k].full_tensor(), torch.randn(s, generator=torch.Generator().manual_seed(ord(k))))
                for k, s in _WIDE.items())
    return {"right": right, "received": res.bytes_received,
            "warned": [str(w.message)[:200] for w in caught if "shared" in str(w.message)]}
