"""The parity plan of MemoryTier(parity=k) (tiers/parity.py), as pure functions: groups cover every node once,
and XOR parity made by the plan rebuilds any one member's file bit for bit, for any group size and file sizes."""

from __future__ import annotations

import random

import pytest

from liferaft.tiers.parity import holder_of, parity_group, rebuild_plan, stripe_in, stripe_size


@pytest.mark.parametrize("nodes", range(1, 13))
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_groups_cover_every_node_once_and_have_two_members(nodes, k):
    names = [f"n{i}" for i in range(nodes)]
    groups = {tuple(parity_group(names, r, k)) for r in range(nodes)}
    members = [r for g in groups for r in g]
    assert sorted(members) == list(range(nodes))                     # every node in exactly one group
    assert all(len(g) >= 2 for g in groups) or nodes == 1             # (a last group of one joins the one before)
    assert all(len(g) <= 2 * k - 1 for g in groups)
    assert all(list(g) == sorted(g) for g in groups)


def test_ranks_at_the_same_position_form_the_groups():
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]                 # 4 nodes × 2 ranks, groups of 2 nodes
    assert parity_group(nodes, 0, 2) == [0, 2] and parity_group(nodes, 3, 2) == [1, 3]
    assert parity_group(nodes, 5, 2) == [5, 7]
    uneven = ["a", "a", "b"]                                           # b has no rank at position 1
    assert parity_group(uneven, 1, 2) == [1] and parity_group(uneven, 0, 2) == [0, 2]


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


@pytest.mark.parametrize("m", [2, 3, 4, 6])
def test_parity_rebuilds_any_one_lost_file(m):
    rng = random.Random(m)
    sizes = [rng.choice([0, 1, 4095, 4096, 9000, 20000]) for _ in range(m)]
    files = [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]
    stripe = stripe_size(sizes)
    assert stripe % 4096 == 0 and stripe * (m - 1) >= max(sizes)

    def part(i: int, s: int) -> bytes:
        return files[i][s * stripe:(s + 1) * stripe].ljust(stripe, b"\0")

    parity = []
    for j in range(m):                               # what member j keeps: every other member's stripe for it
        p = bytes(stripe)
        for i in range(m):
            if i != j:
                p = _xor(p, part(i, stripe_in(i, j, m)))
        parity.append(p)
    for i in range(m):                               # each stripe of each file is in exactly one other parity
        assert sorted(holder_of(i, s, m) for s in range(m - 1)) == [j for j in range(m) if j != i]
        assert all(stripe_in(i, holder_of(i, s, m), m) == s for s in range(m - 1))
    for lost in range(m):
        out = b""
        for s, j, others in rebuild_plan(lost, m):
            assert j != lost and all(i not in (j, lost) for i, _ in others)
            piece = parity[j]
            for i, t in others:
                piece = _xor(piece, part(i, t))
            out += piece
        assert out[:sizes[lost]] == files[lost]
