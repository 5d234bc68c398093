"""The manager's agreement at each maybe_save (``manager.voting``), as pure functions."""

import pytest

from liferaft.manager.voting import Views, agree


def test_a_vote_round_trips_through_its_integers():
    v = Views(time=True, preempt=False, memory=True, log_full=False, log_half=True)
    assert v.ints() == [1, 0, 1, 0, 1]
    assert Views.of(v.ints()) == v
    assert Views.of([3, 0, 0, 0, 7]) == Views(time=True, log_half=True)    # (a maximum: anything above 0 is a yes)
    with pytest.raises(ValueError, match="5 values"):
        Views.of([1, 0, 0])


@pytest.mark.parametrize("reason", [None, "every_steps", "every_seconds", "force"])
@pytest.mark.parametrize("time_voted", [False, True])
def test_the_time_interval_is_decided_by_the_vote_alone(reason, time_voted):
    got, _ = agree(reason, Views(time=reason == "every_seconds"), Views(time=time_voted), auto_memory=False)
    if reason not in (None, "every_seconds"):
        assert got == reason                    # a step-based reason is the same on every rank: kept
    else:                                       # this rank's clock counts only through the vote
        assert got == ("every_seconds" if time_voted else None)


@pytest.mark.parametrize("auto_memory", [False, True])
def test_the_memory_save_is_voted_only_when_its_interval_is_a_time(auto_memory):
    local, voted = Views(memory=False), Views(memory=True, preempt=True, log_full=True, log_half=True)
    _, views = agree(None, local, voted, auto_memory)
    assert views.memory is auto_memory          # a step count: this rank's own view (the same on every rank)
    assert (views.preempt, views.log_full, views.log_half) == (True, True, True)   # the rest as voted
    _, views = agree(None, Views(memory=True), Views(), auto_memory)
    assert views.memory is not auto_memory
