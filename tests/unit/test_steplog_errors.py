"""The per-step log's record failing inside ``maybe_save`` (one process): the call's decisions are still made,
then the record's error is raised; an error of the call itself (its save) is raised instead, naming the record's
too — never one silently dropped."""

from __future__ import annotations

import warnings

import pytest
from test_steplog_local import _manager, _state, _step


def _trained_to(tmp_path, at: int):
    """A manager whose record of step ``at`` fails, the state trained to ``at`` (maybe_save called before it)."""
    st = _state()
    mgr = _manager(tmp_path, 16, 4)
    mgr.restore(st)
    _failing(mgr, at)
    for s in range(at + 1):
        _step(st, s)
        if s < at:
            mgr.maybe_save(s, st)
    return st, mgr


def _failing(mgr, at: int) -> None:
    log = mgr._steplog
    publish = log._publish

    def fail(cur, doc, cuda):
        if doc["step"] == at:
            raise OSError(28, "injected: no space left for the record")
        return publish(cur, doc, cuda)
    log._publish = fail


def test_the_record_error_is_raised_after_the_save_of_that_step(tmp_path):
    st, mgr = _trained_to(tmp_path, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match="injected") as e:
            mgr.maybe_save(4, st)
    assert "still started a save" in str(e.value.__notes__)
    assert 4 in [i.step for i in mgr.steps() if i.status == "committed"]       # (every_steps=4: taken all the same)
    mgr.close()


def test_a_save_that_fails_after_the_record_failed_names_both(tmp_path):
    st, mgr = _trained_to(tmp_path, 4)
    real = mgr._save

    def save(step, *a, **k):
        if step == 4:
            raise RuntimeError("injected: the save failed too")
        return real(step, *a, **k)
    mgr._save = save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="the save failed too") as e:
            mgr.maybe_save(4, st)
    assert "per-step record of step 4 had failed on this rank too" in str(e.value.__notes__)
    assert "no space left for the record" in str(e.value.__notes__)
    mgr._save = real
    mgr.close()


@pytest.mark.parametrize("error", [RuntimeError("injected: CUDA out of memory (pinned buffers)"),
                                   MemoryError("injected: no memory for the copy")])
def test_a_capture_that_fails_on_one_rank_lets_the_step_run_and_maybe_save_raises(tmp_path, error):
    """Not only a full /dev/shm: whatever a gradient's copy meets on this rank alone (no pinned memory, no memory)
    must not skip this rank's optimizer step (its peers take theirs); ``maybe_save`` raises it."""
    import torch

    st = _state()
    mgr = _manager(tmp_path, 16, 4)
    mgr.restore(st)
    for s in range(2):
        _step(st, s)
        mgr.maybe_save(s, st)
    log = mgr._steplog
    put = log._put

    def fail(t):
        raise error
    log._put = fail
    before = st["model"][0].weight.detach().clone()
    _step(st, 2)
    log._put = put
    assert not torch.equal(before, st["model"][0].weight)             # the optimizer stepped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(type(error), match="injected"):
            mgr.maybe_save(2, st)
    _step(st, 3)
    mgr.maybe_save(3, st)                                               # and the log goes on
    mgr.close()
