"""GlobalSampler: one global order whatever the data-parallel size; state saved once, resumed on any rank count."""

from __future__ import annotations

from collections import Counter

import pytest

import liferaft
from liferaft.data import GlobalSampler, global_order
from liferaft.errors import StateMismatchError

SOURCES = {"web": 50, "code": 17, "books": 8}
WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}


def samplers(world, state=None, batch=12):
    out = [GlobalSampler(SOURCES, weights=WEIGHTS, global_batch_size=batch, seed=7, rank=r, world=world)
           for r in range(world)]
    if state is not None:
        for s in out:
            s.load_state_dict(state)
    return out


def run(ss, n):
    """n global batches from the ranks' samplers, in global order."""
    its = [s.batches() for s in ss]
    return [x for _ in range(n) for x in global_order([next(it) for it in its])]


def test_reference_is_the_same_for_every_world_size():
    ref = run(samplers(1), 20)
    assert run(samplers(2), 20) == ref and run(samplers(3), 20) == ref and run(samplers(4), 20) == ref


@pytest.mark.parametrize("before,after", [(2, 3), (4, 2), (3, 1), (1, 4)])
def test_resume_on_another_world_size_continues_the_same_order(before, after):
    ref = run(samplers(1), 15)
    first = samplers(before)
    head = run(first, 6)
    state = first[0].state_dict()
    assert all(s.state_dict() == state for s in first)            # global: the same on every rank
    tail = run(samplers(after, state), 9)
    assert head + tail == ref                                     # nothing skipped, nothing repeated


def test_passes_cover_each_source_once_per_epoch_and_weights_hold():
    one = GlobalSampler({"a": 10}, global_batch_size=5, seed=1)
    it = one.batches()
    first_pass = [s.index for _ in range(2) for s in next(it)]
    second_pass = [s.index for _ in range(2) for s in next(it)]
    assert sorted(first_pass) == list(range(10)) and sorted(second_pass) == list(range(10))
    assert first_pass != second_pass                              # reshuffled each pass
    mix = run(samplers(1, batch=100), 100)                        # 10 000 samples
    share = Counter(src for src, _ in mix)
    for name, w in WEIGHTS.items():
        assert abs(share[name] / len(mix) - w) < 0.02, share


def test_state_after_the_batches_trained_with_prefetching():
    ref = run(samplers(2), 10)
    ss = samplers(2)
    run(ss, 7)                                                     # a loader prefetched 7, training used 4
    state = ss[0].state_dict(batches_trained=4)
    assert run(samplers(3, state), 6) == ref[4 * 12:]
    with pytest.raises(liferaft.OptionsError):
        ss[0].state_dict(batches_trained=8)


def test_state_through_a_checkpoint_and_mismatch_errors(tmp_path):
    ss = samplers(1)
    run(ss, 3)
    liferaft.save(str(tmp_path / "ck"), {"data": ss[0]})
    fresh = samplers(1)[0]
    liferaft.load(str(tmp_path / "ck"), {"data": fresh})
    assert fresh.state_dict() == ss[0].state_dict() and fresh.position == 36
    other = GlobalSampler({"web": 51}, global_batch_size=12, seed=7)
    with pytest.raises(StateMismatchError, match="sources"):
        other.load_state_dict(ss[0].state_dict())


def test_flat_indices_address_the_concatenated_sources():
    s = samplers(1)[0]
    batch = next(s.batches())
    offsets = {"web": 0, "code": 50, "books": 67}
    assert all(x.flat == offsets[x.source] + x.index for x in batch)
    assert next(iter(samplers(1)[0])) == [x.flat for x in batch]
