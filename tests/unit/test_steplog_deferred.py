"""The per-step log's background publish (what a record with CUDA tensors takes: ``tiers.stepcuda``), run on the
CPU. This machine has no GPU, so the ``deferred`` fixture stands in for the CUDA layer only: every tensor of a
record goes through ``CudaCopies`` as a CUDA tensor does — copied into its generation's buffer at capture, the
copy's "event" a slow one (a D2H copy still running), written, hashed and published by the background thread —
with real slot files, a real manager, real restores. ``benchmarks/gpu_check.sh`` runs the real CUDA path.

Found by a review of the change (2026-12-06): a failed background publish lost its step for good (the CPU path's
retry of ``maybe_save`` too), and an interrupted wait let ``close`` unmap a slot under the background copy."""

from __future__ import annotations

import concurrent.futures
import errno
import threading
import time
import warnings

import pytest
import torch
from cudastandin import copy_to_generation, put_deferred
from test_steplog_local import _manager, _run, _state, _step, _tensors

from liferaft.errors import FileAccessError
from liferaft.tiers import stepcuda, steplog, stepslot


class _SlowCopy:
    """A copy's event whose copy is still running for ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def synchronize(self) -> None:
        time.sleep(self.delay)


@pytest.fixture
def deferred(monkeypatch):
    """Every record's tensors through the background publish; returns the generations written while drained."""
    draining, races = [0, 0], []

    def enqueue(self, t, off, gen):
        if draining[gen]:
            races.append((off, gen))
        return copy_to_generation(self, t, off, gen, _SlowCopy(0.01))

    drain = stepcuda.CudaCopies.drain

    def draining_drain(self, f, copies, gen):
        draining[gen] += 1
        try:
            return drain(self, f, copies, gen)
        finally:
            draining[gen] -= 1

    monkeypatch.setattr(stepcuda.CudaCopies, "enqueue", enqueue)
    monkeypatch.setattr(stepcuda.CudaCopies, "fence", lambda self, since: None)
    monkeypatch.setattr(stepcuda.CudaCopies, "drain", draining_drain)
    monkeypatch.setattr(steplog.StepLog, "_put", put_deferred)      # (its CUDA branch for every tensor)
    return races


@pytest.fixture
def fail_header(monkeypatch):
    """``fail_header(step, n)``: the next ``n`` reservations of the header of step ``step``'s record fail as a
    full /dev/shm does."""
    left, target = [0], [-1]
    armed = threading.local()
    encode = steplog.encode_header

    def arming_encode(doc):
        armed.on = left[0] > 0 and doc["step"] == target[0]    # (its reservation follows on the same thread)
        return encode(doc)

    reserve = stepslot.Slot.reserve

    def failing_reserve(self, size, *a, **k):
        if getattr(armed, "on", False):
            armed.on = False
            left[0] -= 1
            raise FileAccessError(errno.ENOSPC, f"{self.path}: cannot reserve {size} bytes (injected)")
        return reserve(self, size, *a, **k)

    monkeypatch.setattr(steplog, "encode_header", arming_encode)
    monkeypatch.setattr(stepslot.Slot, "reserve", failing_reserve)

    def arm(step: int, n: int) -> None:
        target[0], left[0] = step, n
    return arm


def _same(st: dict, ref: dict) -> bool:
    want = _tensors(ref)
    return all(torch.equal(v, _tensors(st)[k]) for k, v in want.items())


def _started(tmp_path) -> tuple[dict, object]:
    st = _state()
    mgr = _manager(tmp_path / "run", every=100)
    mgr.restore(st)
    return st, mgr


def _resumes_at(tmp_path, step: int, ref: dict) -> None:
    """A fresh state restored from the run in ``tmp_path`` resumes at ``step``, with no gap warned about, and
    equals ``ref``."""
    st = _state()
    mgr = _manager(tmp_path / "run", every=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # (no gap: every step's record is there)
        assert mgr.restore(st) == step
    mgr.close()
    assert _same(st, ref)


def test_records_published_in_the_background_resume_bitwise(tmp_path, deferred):
    ref = _run(tmp_path / "ref", 9)
    for last in (5, 7):
        _run(tmp_path / f"run{last}", last)
        st = _state()
        mgr = _manager(tmp_path / f"run{last}")
        assert mgr.restore(st) == last
        assert mgr._steplog.last_recovery["replayed"] >= 1
        for s in range(last + 1, 10):
            _step(st, s)
            mgr.maybe_save(s, st)
        mgr.close()
        assert _same(st, ref), last
    assert deferred == []                       # no generation written while the background drained it


def test_a_background_publish_that_fails_is_published_again_by_the_next_step(tmp_path, deferred, fail_header):
    ref = _run(tmp_path / "ref", 8)
    st, mgr = _started(tmp_path)
    for s in range(9):
        _step(st, s)
        if s == 4:
            fail_header(4, 1)                   # the background's header reservation of step 4 fails, once
        mgr.maybe_save(s, st)                   # step 5's waits for it, publishes it again: nothing raised
    mgr.close()
    _resumes_at(tmp_path, 8, ref)


def test_a_record_that_cannot_be_published_names_its_step_and_a_full_checkpoint_follows(tmp_path, deferred,
                                                                                        fail_header):
    ref = _run(tmp_path / "ref", 8)
    st, mgr = _started(tmp_path)
    for s in range(4):
        _step(st, s)
        mgr.maybe_save(s, st)
    _step(st, 4)
    fail_header(4, 2)                           # in the background, and again when the next step retries it
    mgr.maybe_save(4, st)
    _step(st, 5)
    with pytest.raises(FileAccessError, match="injected") as e:
        mgr.maybe_save(5, st)       # (raised once the call's decisions are made: the full checkpoint the hole asks)
    assert "record of step 4 was not published" in str(e.value.__notes__)
    assert "still started a save" in str(e.value.__notes__)
    mgr.wait()
    assert 5 in [i.step for i in mgr.steps() if i.status == "committed"]    # only a full checkpoint makes the
    assert not mgr._steplog.save_due                                       # steps after the hole count again
    assert not mgr.maybe_save(5, st)            # step 5 again: recorded (its calls kept), no second save
    for s in range(6, 9):
        _step(st, s)
        mgr.maybe_save(s, st)
    mgr.close()
    _resumes_at(tmp_path, 8, ref)


def test_on_the_cpu_a_record_whose_header_cannot_be_reserved_is_recorded_by_a_retry(tmp_path, fail_header):
    ref = _run(tmp_path / "ref", 8)
    st, mgr = _started(tmp_path)
    for s in range(9):
        _step(st, s)
        if s == 4:
            fail_header(4, 1)
            with pytest.raises(FileAccessError, match="injected"):
                mgr.maybe_save(s, st)
        mgr.maybe_save(s, st)                   # (step 4: the retry records it; its calls were kept)
    mgr.close()
    _resumes_at(tmp_path, 8, ref)


def _big() -> dict:
    st = _state()
    st["model"].register_buffer("big", torch.ones(16 << 20))     # 64 MiB of the rest of the state: a long drain
    return st


def test_an_interrupted_wait_leaves_the_publish_running_and_close_waits_for_it(tmp_path, deferred, monkeypatch):
    ref = _big()
    for s in range(3):
        _step(ref, s)
    st = _big()
    mgr = _manager(tmp_path / "run", every=100)
    mgr.restore(st)
    armed, gate = [False], threading.Event()
    result = concurrent.futures.Future.result
    publish = steplog.StepLog._publish

    def interrupted(self, timeout=None):
        if armed[0] and not self.done():
            armed[0] = False
            raise KeyboardInterrupt         # what a SIGINT raises from inside the wait
        return result(self, timeout)

    def held_back(self, cur, doc, cuda):        # step 2's copies still running until the gate opens
        if doc["step"] == 2:
            gate.wait(120)
        return publish(self, cur, doc, cuda)

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    monkeypatch.setattr(steplog.StepLog, "_publish", held_back)
    for s in range(3):
        _step(st, s)
        mgr.maybe_save(s, st)
    _step(st, 3)
    armed[0] = True
    with pytest.raises(KeyboardInterrupt):
        mgr.maybe_save(3, st)                   # waits for step 2's publish: interrupted
    assert armed == [False] and mgr._steplog._pending is not None      # still in flight, not forgotten
    gate.set()
    mgr.close()                                 # waits for it (copying the 64 MiB) before any slot is closed
    st = _big()
    mgr = _manager(tmp_path / "run", every=100)
    assert mgr.restore(st) == 2
    mgr.close()
    assert _same(st, ref)


class _Interrupted:
    """The pending work as a wait interrupted by Ctrl-C sees it: ``result()`` raises once, not done."""

    def __init__(self, real) -> None:
        self.real, self.left = real, 1

    def result(self):
        if self.left:
            self.left -= 1
            raise KeyboardInterrupt
        return self.real.result()

    def done(self) -> bool:
        return self.real.done() if not self.left else False

    def exception(self):
        return self.real.exception()


def test_a_broken_capture_after_an_interrupted_wait_keeps_the_generations_apart(tmp_path, deferred, monkeypatch):
    """Record 3 is still being published in the background (its wait interrupted by Ctrl-C) when step 4's capture
    breaks and its record is dropped: the next record must not take record 3's pinned generation (found by a
    review: it did, and record 3 was published, checksum valid, with step 5's gradients)."""
    from liferaft.tiers.steplist import slot_name
    from liferaft.tiers.steprecord import read_header, read_record

    st, mgr = _started(tmp_path)
    for step in range(3):
        _step(st, step)
        mgr.maybe_save(step, st)
    log = mgr._steplog
    gate = threading.Event()
    drain = stepcuda.CudaCopies.drain

    def held(self, f, copies, gen):             # (record 3's publish waits here until the end)
        gate.wait(10)
        return drain(self, f, copies, gen)
    monkeypatch.setattr(stepcuda.CudaCopies, "drain", held)
    grads = {}

    def seen(opt, args, kwargs) -> None:        # (the gradient each step consumes)
        grads[len(grads)] = opt.param_groups[0]["params"][0].grad.clone()
    hook = st["optim"].register_step_pre_hook(seen)
    _step(st, 3)
    mgr.maybe_save(3, st)                       # published in the background, held at its drain
    put = log._put

    def no_room(t):
        raise OSError(errno.ENOSPC, "injected: no room")
    log._put = no_room
    _step(st, 4)                                # its capture breaks: the step runs
    log._put = put
    log._pending = _Interrupted(log._pending)
    with pytest.raises(KeyboardInterrupt):
        mgr.maybe_save(4, st)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(st, 5)                            # its copies: not into record 3's generation
    hook.remove()
    gate.set()
    log.wait()
    slot = next(s for s, v in log.ring.held.items() if v == 3)
    header = read_header(log.root, slot_name(0, slot))
    data = read_record(log.root, slot_name(0, slot), header.length)
    e = header.doc["calls"][0]["grads"][0]
    got = torch.frombuffer(bytearray(data[e["off"]:e["off"] + e["len"]]), dtype=torch.float32).reshape(grads[0].shape)
    mgr.close()
    assert torch.equal(got, grads[0]) and not deferred, (torch.equal(got, grads[2]), deferred)
