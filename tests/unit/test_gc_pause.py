"""Python's cyclic garbage collector is paused while a liferaft call of the main thread runs
(``core.process.CallGate`` through ``format.jsonsafe.GC_PAUSE``): a call's own objects set off full collections
that traverse the whole process and free nothing (6-8 of them in a save of 20,000 small tensors). Enabled again
when no holder is left, however the call returns; a collector the caller disabled stays disabled; calls of other
threads do not pause it; liferaft's own pauses in other threads share the count; a forked child starts with no
call running and the collector as it was. Found by a review: holders that each saved and restored
``gc.isenabled()`` left it disabled for good when they interleaved."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest
import torch

import liferaft
from liferaft.core.process import CALLS
from liferaft.format.jsonsafe import paused_gc


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


def _held_save(path: str, inside: threading.Event, go_on: threading.Event, seen: list[bool],
               errors: list[BaseException]) -> threading.Thread:
    """A save in a thread whose state_dict() notes the collector's state and waits for ``go_on``."""
    def hold() -> None:
        inside.set()
        go_on.wait(30)

    def run() -> None:
        hook = _Hook(hold)
        try:
            liferaft.save(path, {"h": hook, "t": torch.ones(4)})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        seen.extend(hook.seen)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_calls_of_other_threads_do_not_pause_it_and_the_main_threads_call_ends_its_own(tmp_path):
    gc.enable()
    liferaft.save(str(tmp_path / "b"), {"h": _Hook(), "t": torch.ones(4)})
    inside, go_on = threading.Event(), threading.Event()
    seen: list[bool] = []
    errors: list[BaseException] = []
    t = _held_save(str(tmp_path / "a"), inside, go_on, seen, errors)
    try:
        assert inside.wait(30)
        assert gc.isenabled()                       # a call of another thread: the training loop may run
        hook = _Hook()
        dest = {"h": hook, "t": torch.zeros(4)}
        liferaft.load(str(tmp_path / "b"), dest)    # the main thread's call, while the other one runs
        assert hook.seen and not any(hook.seen) and torch.equal(dest["t"], torch.ones(4))
        assert gc.isenabled()                       # ended by the main thread's return, the other still runs
    finally:
        go_on.set()
        t.join(60)
    assert not t.is_alive() and errors == [] and seen == [True]
    assert gc.isenabled()


def test_liferafts_own_pause_in_another_thread_never_leaves_it_disabled():
    gc.enable()
    stop = threading.Event()

    def background() -> None:           # the manager's retention and start-up passes open manifests meanwhile
        while not stop.is_set():
            with paused_gc():
                pass

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)         # (threads switch between any two bytecodes: the interleavings happen)
    t = threading.Thread(target=background)
    t.start()
    try:
        for _ in range(20000):
            with CALLS.call():
                pass
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    assert gc.isenabled()


def _child_says(path: str, in_child) -> bytes:  # type: ignore[no-untyped-def]
    """Fork inside a main-thread save (from its state_dict hook); the child writes ``in_child()`` and leaves."""
    read_end, write_end = os.pipe()
    pids: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                os.write(write_end, in_child())
            finally:
                os._exit(0)
        pids.append(pid)

    liferaft.save(path, {"h": _Hook(fork), "t": torch.ones(4)})
    os.close(write_end)
    try:
        return os.read(read_end, 8)
    finally:
        os.close(read_end)
        for pid in pids:
            os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_inside_a_call_has_the_collector_as_it_was(tmp_path):
    gc.enable()
    assert _child_says(str(tmp_path / "a"), lambda: b"1" if gc.isenabled() else b"0") == b"1"
    assert gc.isenabled()
    gc.disable()
    assert _child_says(str(tmp_path / "b"), lambda: b"1" if gc.isenabled() else b"0") == b"0"
    assert not gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_another_thread_is_in_a_call_can_release(tmp_path):
    """A DataLoader worker forked by the training thread while a save runs in another thread: no call runs in
    the child, so its ``release()`` does not wait for the parent's (it waited forever)."""
    gc.enable()
    liferaft.save(str(tmp_path / "q"), {"t": torch.ones(2)})
    inside, go_on = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    t = _held_save(str(tmp_path / "p"), inside, go_on, [], errors)
    try:
        assert inside.wait(30)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)
                liferaft.read(str(tmp_path / "q"))
                liferaft.release()
                code = 0 if gc.isenabled() else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        go_on.set()
        t.join(60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert not t.is_alive() and errors == []
