"""tiers.stepring.Ring: the per-step log's ring bookkeeping, as pure decisions (no files, no ranks)."""

from __future__ import annotations

from liferaft.tiers.stepplan import AUTO_MIN
from liferaft.tiers.stepring import Ring


def test_slots_are_taken_in_order_then_freed_by_a_durable_checkpoint():
    r = Ring(3)
    for step in range(1, 4):
        slot, dropped = r.free_slot()
        assert (slot, dropped) == (step - 1, None)
        r.held[slot], r.recorded = step, step
    assert r.full and r.full_after_next() and r.held_steps() == [1, 2, 3]
    r.busy = 0
    assert r.free_slot() == (0, 1)                  # full, nothing listed: the oldest is dropped (the caller warns)
    r.mark_durable(2)
    assert r.lag == 1 and r.durable == 2 and not r.full and r.held_steps() == [3]
    assert r.free_slot() == (1, None)               # slot 0 is busy (the background reads it): the next free one


def test_records_a_recovery_listed_are_never_dropped_and_growth_is_bounded():
    r = Ring(None)
    assert r.auto and r.size == AUTO_MIN
    r.durable, r.listed = 10, 14
    r.held = {0: 11, 1: 12, 2: 13, 3: 14}
    assert r.free_slot() == (4, None)
    r.held.update({4: 15, 5: 16, 6: 17})
    assert r.free_slot() == (7, None)
    r.held[7] = 18                                  # this run's own fill a ring's worth: the oldest goes
    assert r.free_slot() == (0, 11)


def test_save_due_at_half_then_by_the_measured_lag_and_at_once_after_a_lost_record():
    r = Ring(10)
    r.held = {i: i + 1 for i in range(4)}
    assert not r.save_due
    r.held[4] = 5
    assert r.save_due                               # half the ring, no lag measured yet
    r.lag = 0
    assert not r.save_due                           # 5 of 10, lag 0: at 10 - 3 = 7
    r.held.update({5: 6, 6: 7})
    assert r.save_due
    r.held, r.lost = {}, 3
    assert r.save_due                               # a hole in the chain: a full checkpoint now
    r.mark_durable(3)
    assert not r.save_due


def test_slots_past_the_ring_go_once_free_never_the_busy_or_the_one_being_written():
    r = Ring(2)
    r.durable = 5
    r.held = {0: 6, 1: 7, 2: 4, 3: 9, 4: 5}
    r.busy = 4
    assert r.past([], None) == [2]                  # 3 holds a newer record; 4 is busy
    assert r.past([3, 5, 6, 7], 6) == [5, 7]        # files seen past the ring holding nothing needed; 6 is written
    assert r.held == {0: 6, 1: 7, 3: 9, 4: 5}


def test_forgetting_the_future_after_a_rollback():
    r = Ring(4)
    r.durable, r.listed = 2, 6
    r.held = {0: 3, 1: 4, 2: 5, 3: 6}
    r.forget_after(4)
    assert r.held == {0: 3, 1: 4} and r.listed == 4
    r.forget_after(1)
    assert r.held == {} and r.listed is None
