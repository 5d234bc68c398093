"""CheckpointManager with incremental saves: references to unchanged chunks, periodic full saves, and retention
that never deletes a step a kept step references."""

from __future__ import annotations

import os

import pytest
import torch

import liferaft
from liferaft import CheckpointManager, SavePolicy
from liferaft.manager.policies import referenced_closure


def fine_tuning_state():
    """A frozen 8 MiB base and a small trainable head with AdamW (what fine-tuning checkpoints look like)."""
    torch.manual_seed(0)
    base = torch.nn.Linear(1024, 2048)
    for p in base.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(2048, 16)
    return {"base": base, "head": head, "optim": torch.optim.AdamW(head.parameters(), lr=1e-2), "step": 0}


def train(state, step):
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))
    state["head"](state["base"](x)).pow(2).mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] = step + 1


def own_bytes(root, step):
    d = os.path.join(root, f"step-{step:010d}")
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(d) for f in fs if f.endswith(".bin"))


@pytest.mark.parametrize("async_save", [False, True])
def test_frozen_weights_are_written_once_per_full_save(tmp_path, async_save):
    root = str(tmp_path / "run")
    state = fine_tuning_state()
    with CheckpointManager(root, every_steps=1, keep_last=2, async_save=async_save,
                           save_policy=SavePolicy(full_every=3)) as mgr:
        for step in range(7):
            train(state, step)
            mgr.maybe_save(step, state)
    with CheckpointManager(root) as mgr:          # (the first one's deletions have finished at its close)
        info = {i.step: i for i in mgr.steps()}
    base_bytes = 2048 * 1024 * 4
    # full saves at steps 0, 3, 6; the others reference the frozen base of the full save before them
    assert [info[s].since_full for s in sorted(info)] == [i % 3 for i in sorted(info)]
    assert info[6].depends_on == () and info[5].depends_on == (3,)
    # kept: 5 and 6 (keep_last) and 3 (5 references it); 0, 1, 2, 4 deleted
    assert sorted(info) == [3, 5, 6]
    assert own_bytes(root, 3) > base_bytes and own_bytes(root, 5) < base_bytes // 20
    for step in (3, 5, 6):
        liferaft.verify(os.path.join(root, f"step-{step:010d}"))
    fresh = fine_tuning_state()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh, step=5) == 5
    fresh_head = fresh["head"].weight
    assert fresh["step"] == 6 and fresh_head.shape == state["head"].weight.shape


def test_retention_keeps_a_referenced_step_until_nothing_kept_refers_to_it(tmp_path):
    root = str(tmp_path / "run")
    state = fine_tuning_state()
    with CheckpointManager(root, every_steps=1, keep_last=1, async_save=False,
                           save_policy=SavePolicy(full_every=100)) as mgr:
        for step in range(4):
            train(state, step)
            mgr.maybe_save(step, state)
    with CheckpointManager(root) as mgr:
        listing = mgr.steps()
    assert [i.step for i in listing] == [0, 3] and listing[1].depends_on == (0,)
    final = {k: v.clone() for k, v in state["head"].state_dict().items()}
    fresh = fine_tuning_state()
    with CheckpointManager(root, every_steps=1, keep_last=1, async_save=False,
                           save_policy=SavePolicy(full_every=1)) as mgr:
        assert mgr.restore(fresh) == 3
        assert all(torch.equal(fresh["head"].state_dict()[k], v) for k, v in final.items())
        train(fresh, 4)
        mgr.maybe_save(4, fresh)            # full (full_every=1): 0 and 3 are no longer needed
        mgr.wait()
    with CheckpointManager(root) as mgr:
        assert [(i.step, i.depends_on) for i in mgr.steps()] == [(4, ())]


def test_restore_continues_the_chain_from_what_the_manifest_says(tmp_path):
    root = str(tmp_path / "run")
    state = fine_tuning_state()
    with CheckpointManager(root, every_steps=1, async_save=False, save_policy=SavePolicy(full_every=3)) as mgr:
        for step in range(2):
            train(state, step)
            mgr.maybe_save(step, state)
    with CheckpointManager(root, every_steps=1, async_save=False, save_policy=SavePolicy(full_every=3)) as mgr:
        assert mgr.restore(state) == 1
        train(state, 2)
        mgr.maybe_save(2, state)            # since_full 2: incremental
        train(state, 3)
        mgr.maybe_save(3, state)            # since_full would be 3: a full save
        info = {i.step: i for i in mgr.steps()}
    assert (info[2].since_full, info[2].depends_on) == (2, (0,))
    assert (info[3].since_full, info[3].depends_on) == (0, ())


def test_without_incremental_every_save_is_full(tmp_path):
    root = str(tmp_path / "run")
    state = fine_tuning_state()
    with CheckpointManager(root, every_steps=1, async_save=False, save_policy=SavePolicy(full_every=1)) as mgr:
        for step in range(3):
            train(state, step)
            mgr.maybe_save(step, state)
        assert all(i.depends_on == () and i.since_full == 0 for i in mgr.steps())


def test_referenced_closure_is_transitive():
    assert referenced_closure({5}, {5: (3,), 3: (1,), 1: (), 4: (0,)}) == {5, 3, 1}
    assert referenced_closure(set(), {1: (0,)}) == set()


@pytest.mark.parametrize("rows", [1023, 1024, 1100])
def test_a_chunk_as_large_as_the_pool_is_still_referenced(tmp_path, rows):
    """A sync save streams through a pool the size of the state: a 1024 x 1024 weight plus its bias fill it exactly.
    Pieces used to be a quarter of the pool, not a whole number of pages, and every page-aligned piece left a gap:
    the 4 MiB weight could never be held whole and was rewritten at every save (found by a hostile review)."""
    from liferaft.staging.pool import PAGE
    from liferaft.staging.stager import streamed_piece_limit

    assert all(streamed_piece_limit(c) % PAGE == 0 for c in (4198400, 4 << 20, (64 << 20) + 4096, 10**9))
    root = str(tmp_path / "run")
    lin = torch.nn.Linear(1024, rows)
    with CheckpointManager(root, every_steps=1, async_save=False) as mgr:
        for i in range(3):
            with torch.no_grad():
                lin.bias.fill_(i)                   # only the bias changes
            mgr.maybe_save(i, {"m": lin})
        steps = mgr.steps()
    assert [s.depends_on for s in steps] == [(), (0,), (0,)]
    assert all(own_bytes(root, s) < 8192 for s in (1, 2))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_unchanged_chunk_as_large_as_the_pool_is_referenced(tmp_path, asynchronous):
    """memory_budget equal to the chunk: the unchanged chunk is still held whole and referenced by the next
    saves (helper-117: written again at every save once large pieces took 64 bytes more than the pool)."""
    root = str(tmp_path / "root")
    state = {"frozen": torch.randn(4 << 20), "step": 0}      # one 16 MiB chunk
    with liferaft.CheckpointManager(root, every_steps=1, async_save=asynchronous,
                                    save_policy=liferaft.SavePolicy(full_every=5),
                                    save_options=liferaft.SaveOptions(memory_budget=16 << 20)) as mgr:
        for step in range(3):
            state["step"] = step
            mgr.maybe_save(step, state)
    own = [sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(os.path.join(root, f"step-{s:010d}"))
               for f in fs if f.endswith(".bin")) for s in range(3)]
    assert own[0] >= 16 << 20 and own[1] == own[2] == 0
