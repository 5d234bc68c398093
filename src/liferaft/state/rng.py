"""RNGState: the random streams of this rank (torch CPU and CUDA, numpy's global generator, Python ``random``).

Put one in the state (``{"rng": liferaft.RNGState(), ...}``). Each rank saves its own streams (stored per rank).
A load into the same number of ranks gives every rank back exactly its streams, so a resumed run draws the same
numbers as an uninterrupted one. A load into another number of ranks cannot give each new rank "its" stream;
then every rank gets fresh streams derived from the saved ones and its new rank (deterministic and different per
rank), and a warning says so.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from typing import Any

import numpy as np
import torch


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RNGState:
    """Saves and restores this rank's random number generators (see the module doc). ``cuda``: include the CUDA
    generators of all visible devices when CUDA is available (default)."""

    #: liferaft passes values that differ per saving rank as a whole ``PerRank`` tuple when the world size
    #: changed, instead of refusing the load (see ``api.load``)
    accepts_per_rank = True

    def __init__(self, cuda: bool = True) -> None:
        self.cuda = cuda

    def state_dict(self) -> dict[str, Any]:
        rank, world = _rank_world()
        np_state = np.random.get_state()
        py_state = random.getstate()
        sd: dict[str, Any] = {
            "rank": rank, "world": world,
            "torch": torch.get_rng_state().numpy().tobytes(),
            "numpy": {"key": np_state[1].astype(np.uint32).tobytes(), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
            "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
        }
        if self.cuda and torch.cuda.is_available():
            sd["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from liferaft.state.values import PerRank

        rank, world = _rank_world()
        per_rank = [v for v in sd.values() if isinstance(v, PerRank)]
        saved = sd.get("world")
        if per_rank or (type(saved) is int and saved != world):   # saved by another number of ranks
            # (a save by one rank holds no per-rank values: its streams would reach every rank alike)
            saved_world = len(per_rank[0]) if per_rank else saved
            warnings.warn(f"liferaft.RNGState: saved by {saved_world} rank(s), loaded on {world}: each rank gets "
                          "fresh random streams derived from the saved ones (a resume with the same layout would "
                          "continue them exactly)", stacklevel=2)
            self._reseed(sd, rank)
            return
        torch.set_rng_state(torch.frombuffer(bytearray(sd["torch"]), dtype=torch.uint8))
        n = sd["numpy"]
        np.random.set_state(("MT19937", np.frombuffer(n["key"], dtype=np.uint32).copy(), n["pos"], n["has_gauss"],
                             n["gauss"]))
        p = sd["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
        if "cuda" in sd and self.cuda and torch.cuda.is_available():
            states = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in sd["cuda"]]
            torch.cuda.set_rng_state_all(states[:torch.cuda.device_count()])

    def _reseed(self, sd: dict[str, Any], rank: int) -> None:
        h = hashlib.sha256()
        for key in sorted(sd):                            # every saved stream of every saved rank
            h.update(key.encode() + repr(sd[key]).encode())
        seed = int.from_bytes(hashlib.sha256(h.digest() + rank.to_bytes(8, "little")).digest()[:8], "little")
        torch.manual_seed(seed)                       # CPU and every CUDA device
        np.random.seed(seed % (1 << 32))
        random.seed(seed)
