"""MemoryTier(parity=k): XOR parity across a group of nodes instead of full replicas (REFT). Real ranks in simulated
nodes; the loss of each member of a group rebuilds its files from the survivors' data and parity, bit for bit; two
losses in a group, or a damaged parity, never load anything wrong."""

from __future__ import annotations

import os
import shutil

import pytest
from multiproc._parity_ranks import restore, save

from liferaft.testing import RankFailure, run_ranks


def _node(base: str, name: str) -> str:
    return os.path.join(base, "parity-test", name)


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_the_loss_of_any_member_is_rebuilt_from_parity(shm, lost):
    sizes = run_ranks(save, 4, shm, 1, 4, 2, timeout=120)          # 4 nodes of one rank, one group of 4
    for s in sizes:                                                 # parity: a third of a file per node (m - 1 = 3)
        assert 0 < s["parity"] <= s["data"] // 3 + 8192 and s["parity_steps"] == 1, sizes
    shutil.rmtree(_node(shm, f"n{lost}"))                           # node `lost` is gone, memory and all
    out = run_ranks(restore, 4, shm, 1, 4, timeout=120)
    assert [(step, exact) for step, exact, _ in out] == [(2, True)] * 4, out
    assert all(r["files_rebuilt"] == 1 for _, _, r in out), out


def test_one_loss_in_each_of_two_groups(shm):
    run_ranks(save, 4, shm, 1, 2, 1, timeout=120)                   # parity=2: groups {n0, n1} and {n2, n3}
    shutil.rmtree(_node(shm, "n0"))
    shutil.rmtree(_node(shm, "n3"))
    out = run_ranks(restore, 4, shm, 1, 2, timeout=120)
    assert [(step, exact) for step, exact, _ in out] == [(1, True)] * 4, out
    assert all(r["files_rebuilt"] == 2 for _, _, r in out), out


def test_groups_of_two_nodes_with_two_ranks_each(shm):
    run_ranks(save, 4, shm, 2, 2, 1, timeout=120)                   # 2 nodes × 2 ranks, parity=2: one group
    shutil.rmtree(_node(shm, "n1"))
    out = run_ranks(restore, 4, shm, 2, 2, timeout=120)
    assert [(step, exact) for step, exact, _ in out] == [(1, True)] * 4, out
    assert all(r["files_rebuilt"] == 2 for _, _, r in out), out     # both ranks of the lost node


def test_two_losses_in_a_group_are_not_rebuilt(shm):
    run_ranks(save, 4, shm, 1, 4, 1, timeout=120)
    shutil.rmtree(_node(shm, "n0"))
    shutil.rmtree(_node(shm, "n2"))
    out = run_ranks(restore, 4, shm, 1, 4, timeout=120)
    assert [step for step, _, _ in out] == [None] * 4, out


def test_a_damaged_parity_is_detected_never_loaded(shm):
    run_ranks(save, 4, shm, 1, 4, 1, timeout=120)
    shutil.rmtree(_node(shm, "n0"))
    xor = os.path.join(_node(shm, "n1"), "parity", "step-0000000001", "r1.xor")
    with open(xor, "r+b") as f:     # one bit of the parity rebuilding n0's file, over its first chunk's bytes (its
        f.seek(4096 + 100)          # first 64 bytes are a gap before that chunk, which no load reads)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(RankFailure, match="CorruptCheckpointError"):
        run_ranks(restore, 4, shm, 1, 4, timeout=120)


def test_parity_needs_two_nodes_per_group():
    from liferaft.errors import OptionsError
    from liferaft.tiers.memory import MemoryTier

    for bad in (1, -1, 2.0, True):
        with pytest.raises(OptionsError, match="parity"):
            MemoryTier("x", parity=bad)


def test_parity_headers_that_disagree_with_the_manifest_are_refused_before_a_rebuild(shm):
    import json

    run_ranks(save, 4, shm, 1, 4, 1, timeout=120)
    shutil.rmtree(_node(shm, "n0"))
    for r in (1, 2, 3):                         # every live header gives n0's file another (smaller) size
        path = os.path.join(_node(shm, f"n{r}"), "parity", "step-0000000001", f"r{r}.json")
        with open(path) as f:
            doc = json.load(f)
        doc["files"][0][1] -= 4096
        with open(path, "w") as f:
            json.dump(doc, f)
    with pytest.raises(RankFailure, match="parity names .* the manifest"):
        run_ranks(restore, 4, shm, 1, 4, timeout=120)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_parity_file_that_is_not_a_regular_file_is_no_parity(shm, kind):
    """A FIFO (which would block a plain open) or a link in place of a parity file: that parity is not used, and
    with it the lost node's file cannot be rebuilt — nothing hangs, nothing is read through the link."""
    run_ranks(save, 4, shm, 1, 4, 1, timeout=120)
    shutil.rmtree(_node(shm, "n0"))
    xor = os.path.join(_node(shm, "n1"), "parity", "step-0000000001", "r1.xor")
    os.replace(xor, xor + ".moved")
    if kind == "fifo":
        os.mkfifo(xor)
    else:
        os.symlink(xor + ".moved", xor)
    out = run_ranks(restore, 4, shm, 1, 4, timeout=120)
    assert [step for step, _, _ in out] == [None] * 4, out
