"""Python's cyclic garbage collector is paused while liferaft calls run (``core.process.CallGate``): a call's own
objects set off full collections that traverse the whole process and free nothing (8 of them in a save of 20,000
small tensors). Enabled again when the last call returns, however it returns; a collector the caller disabled
stays disabled; a child forked inside a call gets it back."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import liferaft


class _Hook:
    """A stateful object that notes whether the collector runs when liferaft calls into it."""

    def __init__(self, on_call=None) -> None:  # type: ignore[no-untyped-def]
        self.seen: list[bool] = []
        self.on_call = on_call

    def state_dict(self) -> dict:
        self.seen.append(gc.isenabled())
        if self.on_call is not None:
            self.on_call()
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        self.seen.append(gc.isenabled())


@pytest.fixture(autouse=True)
def _collector_restored():
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_save_and_load_run_without_the_collector_and_leave_it_enabled(tmp_path):
    gc.enable()
    hook = _Hook()
    state = {"h": hook, "m": {f"k{i}": torch.full((3,), float(i)) for i in range(2000)}}
    liferaft.save(str(tmp_path / "ck"), state)
    assert hook.seen == [False] and gc.isenabled()
    starts: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    dest = {"h": _Hook(), "m": {k: torch.zeros(3) for k in state["m"]}}
    gc.callbacks.append(note)
    try:
        liferaft.load(str(tmp_path / "ck"), dest)
    finally:
        gc.callbacks.remove(note)
    assert dest["h"].seen and not any(dest["h"].seen) and gc.isenabled()   # (state_dict, load_state_dict)
    assert len(starts) <= 1                     # 2,000 keys loaded without a collection (one may start as the
    #                                             call is entered: the callback is in place a few allocations before)
    assert all(torch.equal(dest["m"][k], v) for k, v in state["m"].items())


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path):
    gc.disable()
    hook = _Hook()
    liferaft.save(str(tmp_path / "ck"), {"h": hook, "t": torch.ones(4)})
    liferaft.load(str(tmp_path / "ck"), {"h": hook, "t": torch.zeros(4)})
    assert len(hook.seen) >= 2 and not any(hook.seen) and not gc.isenabled()


def test_a_call_that_fails_leaves_it_enabled(tmp_path):
    gc.enable()

    def fail() -> None:
        raise RuntimeError("state_dict failed")

    with pytest.raises(RuntimeError, match="state_dict failed"):
        liferaft.save(str(tmp_path / "ck"), {"h": _Hook(fail), "t": torch.ones(4)})
    assert gc.isenabled()


def test_concurrent_calls_enable_it_when_the_last_one_returns(tmp_path):
    gc.enable()
    liferaft.save(str(tmp_path / "b"), {"t": torch.ones(4)})
    inside, go_on = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        inside.set()
        go_on.wait(30)

    def slow_save() -> None:
        try:
            liferaft.save(str(tmp_path / "a"), {"h": _Hook(hold), "t": torch.ones(4)})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=slow_save)
    t.start()
    try:
        assert inside.wait(30)
        assert torch.equal(liferaft.read(str(tmp_path / "b"))["t"], torch.ones(4))   # a call inside the other
        assert not gc.isenabled()                   # the save still runs: not enabled by the read's return
    finally:
        go_on.set()
        t.join(60)
    assert not t.is_alive() and errors == []
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_inside_a_call_has_the_collector_back(tmp_path):
    gc.enable()
    read_end, write_end = os.pipe()
    pids: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:                            # the child: says what it has, and leaves at once
            os.write(write_end, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        pids.append(pid)

    liferaft.save(str(tmp_path / "ck"), {"h": _Hook(fork), "t": torch.ones(4)})
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        for pid in pids:
            os.waitpid(pid, 0)
    assert gc.isenabled()
