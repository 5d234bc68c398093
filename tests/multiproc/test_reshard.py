"""Save under one layout on N real ranks, load under another on M ranks; compare every element."""

from __future__ import annotations

import pytest
import torch
from multiproc._reshard_ranks import SHAPES, build_state, load_rank, reference, save_rank

import liferaft
from liferaft.testing import run_ranks

S0 = {"kind": "dtensor", "mesh": (2,), "placements": ["S0"]}
LAYOUTS = {
    "S0@2": (2, S0),
    "S1@3": (3, {"kind": "dtensor", "mesh": (3,), "placements": ["S1"]}),
    "S0@3": (3, {"kind": "dtensor", "mesh": (3,), "placements": ["S0"]}),
    "S0S1@2x2": (4, {"kind": "dtensor", "mesh": (2, 2), "placements": ["S0", "S1"]}),
    "R@2": (2, {"kind": "dtensor", "mesh": (2,), "placements": ["R"]}),
    "S0@4": (4, {"kind": "dtensor", "mesh": (4,), "placements": ["S0"]}),
    "S0S0@2x2": (4, {"kind": "dtensor", "mesh": (2, 2), "placements": ["S0", "S0"]}),
    "RS1@2x2": (4, {"kind": "dtensor", "mesh": (2, 2), "placements": ["R", "S1"]}),
    "sharded2x2": (4, {"kind": "sharded", "parts": 2}),
    "sharded3@3": (3, {"kind": "sharded", "parts": 3}),
    "plain@1": (1, {"kind": "plain"}),
}

MATRIX = [
    ("S0@2", "S1@3"),            # Shard(0) on 2 -> Shard(1) on 3
    ("S0S1@2x2", "plain@1"),     # 2-D mesh -> 1 process
    ("R@2", "S0@3"),             # Replicate -> Shard (size 7 on 3 ranks: uneven)
    ("S0@3", "S0S1@2x2"),        # uneven shards -> 2-D
    ("sharded2x2", "S1@3"),      # hand-made shards with replicas -> DTensor
    ("sharded3@3", "RS1@2x2"),
    ("plain@1", "S0@4"),         # one process -> 4 ranks
    ("S0@4", "sharded2x2"),
    ("S0S0@2x2", "S1@3"),        # one dim sharded over both mesh dims
]


def _load_one_process(path):
    state = build_state(0, 1, {"kind": "plain"}, "zero")
    liferaft.load(path, state)
    return {**{n: torch.equal(state[n], reference(n)) for n in SHAPES}, "rep": torch.equal(state["rep"], reference("a")),
            "meta": state["meta"] == {"step": 12, "name": "run"}}


@pytest.mark.parametrize("src,dst", MATRIX, ids=[f"{a}->{b}" for a, b in MATRIX])
def test_reshard_matrix(tmp_path, src, dst):
    path = str(tmp_path / "ck")
    n_src, lay_src = LAYOUTS[src]
    if n_src == 1:
        liferaft.save(path, build_state(0, 1, lay_src, "ref"))
    else:
        written = run_ranks(save_rank, n_src, path, lay_src)
        if lay_src["kind"] != "sharded" and lay_src.get("placements") == ["R"]:
            assert all(w > 0 for w in written), f"replicated writes not spread: {written}"
    liferaft.verify(path)
    n_dst, lay_dst = LAYOUTS[dst]
    results = [_load_one_process(path)] if n_dst == 1 else run_ranks(load_rank, n_dst, path, lay_dst)
    for rank, res in enumerate(results):
        assert all(res.values()), f"rank {rank}: mismatched {[k for k, v in res.items() if not v]}"
    # and the one-process reader sees the same global tensors
    tree = liferaft.read(path)
    for name in SHAPES:
        assert torch.equal(tree[name], reference(name))


def test_ddp_style_replicated_state_is_spread_over_4_ranks(tmp_path):
    path = str(tmp_path / "ck")
    written = run_ranks(save_rank, 4, path, {"kind": "plain"})
    assert sum(written) == sum(reference(n).numel() * reference(n).element_size() for n in SHAPES) + \
        reference("a").numel() * 4
    assert sum(1 for w in written if w > 0) >= 3, written   # not all bytes on rank 0
    info = liferaft.inspect(path)
    assert info.world_size == 4 and all(t.chunks == 1 for t in info.tensors)
