"""The per-step log in one process: options, a resume past the full checkpoint bit for bit, a step with a closure
refused, and step records read as hostile input (every truncation and damaged byte is a CorruptCheckpointError
naming the file, or no record — never another exception, never a wrong record)."""

from __future__ import annotations

import glob
import itertools
import os
import warnings

import pytest
import torch
from torch import nn

import liferaft
from liferaft import CheckpointManager, MemoryTier, StepLogOptions, TierOptions
from liferaft.errors import CorruptCheckpointError, InvalidStateError, OptionsError
from liferaft.tiers import stepplan
from liferaft.tiers.steplist import remove_after, slot_name
from liferaft.tiers.steprecord import PROLOGUE, parse_record, read_header, read_record


def _state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "seen": 0}


def _step(st: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = st["model"](torch.randn(5, 4, generator=g)).pow(2).mean()
    loss.backward()
    st["optim"].step()
    st["optim"].zero_grad()
    st["sched"].step()
    st["seen"] += 5


def _manager(tmp_path, max_steps: int | str = 16, every: int = 4) -> CheckpointManager:
    tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
    return CheckpointManager(str(tmp_path / "root"), every_steps=every,
                             tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                             step_log=StepLogOptions(replicas=1, max_steps=max_steps), async_save=False)


def _run(tmp_path, last: int) -> dict:
    st = _state()
    mgr = _manager(tmp_path)
    start = mgr.restore(st)
    for step in range(0 if start is None else start + 1, last + 1):
        _step(st, step)
        mgr.maybe_save(step, st)
    mgr.close()
    return st


def _tensors(st: dict) -> dict:
    out = {f"m.{k}": v for k, v in st["model"].state_dict().items()}
    for i, s in st["optim"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v for k, v in s.items()})
    return out


@pytest.mark.parametrize("bad", [{"replicas": -1}, {"max_steps": 1}, {"replicas": True}, {"max_steps": 2.5},
                                 {"max_steps": "Auto"}, {"max_steps": True}, {"max_steps": None}])
def test_options_are_checked(bad):
    with pytest.raises(OptionsError):
        StepLogOptions(**bad)


def test_the_default_ring_is_sized_from_the_first_record_and_the_shared_memory(tmp_path):
    assert StepLogOptions().max_steps == "auto"
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    st = _state()
    mgr.restore(st)
    log = mgr._steplog
    assert log is not None and log.max_steps == stepplan.AUTO_MIN           # (until the first record)
    for step in range(3):
        _step(st, step)
        mgr.maybe_save(step, st)
    vfs = os.statvfs(log.root)
    first = min(log.ring.held, key=log.ring.held.__getitem__)
    header = read_header(log.root, slot_name(0, first))
    assert header is not None
    want, fits = stepplan.ring_size(header.header_off, vfs.f_blocks * vfs.f_frsize, 1, 0)   # (its tensors' bytes)
    assert fits and log.max_steps == want and stepplan.AUTO_MIN <= want <= stepplan.AUTO_MAX
    mgr.close()


@pytest.mark.parametrize(("record", "shm", "here", "kept", "want", "fits"), [
    (1 << 20, 64 << 30, 1, 0, stepplan.AUTO_MAX, True),                      # small records: the cap
    (100 << 20, 64 << 30, 8, 1, 10, True),                                   # 16 GiB / 8 ranks / 2 copies
    (1 << 30, 64 << 30, 8, 1, stepplan.AUTO_MIN, False),                     # even 4 do not fit: 4, warned
    (0, 0, 0, 0, stepplan.AUTO_MIN, False),                                  # no shared memory seen
    (1 << 30, 1 << 40, 1, 0, 252, True),                                     # a slot takes 1/64 more than 1 GiB
])
def test_ring_size(record, shm, here, kept, want, fits):
    got, ok = stepplan.ring_size(record, shm, here, kept)
    assert (got, ok) == (want, fits)
    per = (record + max(stepplan.AUTO_SLACK, record >> 6)) * (1 + kept)
    if ok and got < stepplan.AUTO_MAX:
        assert got * per * max(1, here) <= shm // stepplan.AUTO_SHARE < (got + 1) * per * max(1, here)


@pytest.mark.parametrize(("files", "kept", "want"), [(1024, 1, 64), (1024, 0, 128), (40, 1, stepplan.AUTO_MIN),
                                                     (1 << 20, 1, stepplan.AUTO_MAX), (None, 3, stepplan.AUTO_MAX)])
def test_the_ring_leaves_most_file_descriptors_to_the_process(files, kept, want):
    # two descriptors per slot file (its own and its mapping's), for its ring and the rings it keeps for others
    assert stepplan.ring_size(1 << 10, 1 << 40, 1, kept, files) == (want, True)


def test_records_after_the_first_take_slots_of_their_own_size(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(512, 512)                         # ~1 MiB records: a slot grown by doubling would take 2 MiB
    st = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    mgr.restore(st)
    for step in range(5):
        model(torch.randn(2, 512)).sum().backward()
        st["optim"].step()
        st["optim"].zero_grad()
        mgr.maybe_save(step, st)
    log = mgr._steplog
    assert log is not None
    length = log._last_len
    later = [log._files[slot_name(0, s)].capacity for s in sorted(log.ring.held)[1:]]
    assert later and all(length <= c <= length + max(stepplan.AUTO_SLACK, length >> 6) for c in later), (length, later)
    mgr.close()


def test_a_first_record_that_fails_still_sizes_the_ring(tmp_path):
    # (its peers size theirs at this call: a rank whose record raised votes too, and does not vote again later)
    st = _state()
    mgr = _manager(tmp_path)
    mgr._steplog.ring.auto, mgr._steplog.ring.size = True, stepplan.AUTO_MIN      # (as max_steps="auto")
    mgr.restore(st)
    _step(st, 0)
    mgr.maybe_save(0, st)                               # (hooks the optimizer)
    st["weird"] = object()                              # not a value a record can hold
    _step(st, 1)
    with pytest.raises(liferaft.errors.LiferaftError):
        mgr.maybe_save(1, st)
    log = mgr._steplog
    assert not log.ring.auto and log.max_steps == stepplan.AUTO_MAX
    del st["weird"]
    mgr.close()


def test_a_first_record_without_gradients_sizes_the_ring_for_them(tmp_path, monkeypatch):
    # a first step that GradScaler skipped records no gradient: the ring is sized for the gradients all the same
    torch.manual_seed(0)
    model = nn.Linear(512, 512)                         # ~1 MiB of gradients per record
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = {"model": model, "optim": opt}
    tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
    vfs = os.statvfs(str(tmp_path))
    from liferaft.tiers import steplog as steplog_mod
    share = vfs.f_blocks * vfs.f_frsize // (10 * ((1 << 20) + stepplan.AUTO_SLACK + 8192))   # room for ~10
    monkeypatch.setattr(stepplan, "AUTO_SHARE", share)
    monkeypatch.setattr(steplog_mod, "AUTO_SHARE", share)
    mgr = CheckpointManager(str(tmp_path / "root"), every_steps=10 ** 6,
                            tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                            step_log=StepLogOptions(replicas=1), async_save=False)
    mgr.restore(st)
    mgr.maybe_save(0, st)                               # (hooks the optimizer)
    mgr.maybe_save(1, st)                               # no optimizer step: a record without gradients
    log = mgr._steplog
    assert log is not None and 8 <= log.max_steps <= 11, log.max_steps
    mgr.close()


@pytest.mark.parametrize("second", ["auto", 4])
def test_a_restart_into_a_smaller_ring_removes_the_slots_past_it(tmp_path, monkeypatch, second):
    # the last run's records all at or below its last full checkpoint (step 9): not listed by the recovery, their
    # slot files past this run's ring go at its first record
    st = _state()
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    mgr.restore(st)
    for step in range(10):
        _step(st, step)
        mgr.maybe_save(step, st, force=step == 9)
    assert mgr._steplog is not None and len(os.listdir(os.path.join(mgr._steplog.root, "r00000"))) >= 9
    mgr.close()
    if second == "auto":
        from liferaft.tiers import steplog as steplog_mod
        monkeypatch.setattr(stepplan, "AUTO_SHARE", 1 << 40)
        monkeypatch.setattr(steplog_mod, "AUTO_SHARE", 1 << 40)
    st = _state()
    mgr = _manager(tmp_path, second, 10 ** 6)
    assert mgr.restore(st) == 9
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*shared memory.*")
        _step(st, 10)
        mgr.maybe_save(10, st)
    log = mgr._steplog
    assert log is not None and log.max_steps == 4
    assert all(int(n.removeprefix("slot-")) < 4 for n in os.listdir(os.path.join(log.root, "r00000")))
    assert 10 in log.ring.held.values()
    mgr.close()


@pytest.mark.parametrize("second", ["auto", 4])
def test_a_restart_into_a_smaller_ring_drops_no_record(tmp_path, monkeypatch, second):
    # the last run left 9 records past its only full checkpoint (step 0) in a ring of 256; this run's ring holds 4
    # (sized so, or set so): its first record must take a free slot, not overwrite a record a recovery still
    # needs; the ring, full, then takes a full checkpoint, which frees them
    def manager(max_steps="auto"):
        tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
        return CheckpointManager(str(tmp_path / "root"), every_steps=10 ** 6,
                                 tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                                 step_log=StepLogOptions(replicas=1, max_steps=max_steps), async_save=False)
    st = _state()
    mgr = manager()
    mgr.restore(st)
    for step in range(10):
        _step(st, step)
        mgr.maybe_save(step, st)
    assert mgr._steplog is not None and mgr._steplog.max_steps > 9
    mgr._steplog.close()                        # (as a crash leaves them: the records stay in shared memory)
    mgr._steplog = None
    mgr.close()
    from liferaft.tiers import steplog as steplog_mod
    monkeypatch.setattr(stepplan, "AUTO_SHARE", 1 << 40)
    monkeypatch.setattr(steplog_mod, "AUTO_SHARE", 1 << 40)
    st = _state()
    mgr = manager(second)
    assert mgr.restore(st) == 9
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ring.*is full.*")
        warnings.filterwarnings("ignore", message=".*shared memory.*")
        _step(st, 10)
        mgr.maybe_save(10, st)
    log = mgr._steplog
    assert log is not None and log.max_steps == 4
    assert log.durable == 10 and not log.held_steps()         # (the full ring's save, at once: one rank)
    # the slots past the ring (the last run's records, and step 10's, taken past them) are gone once free
    assert sorted(os.listdir(os.path.join(log.root, "r00000"))) == [f"slot-{i:04d}" for i in range(4)]
    assert max(log.ring.held) < 4
    mgr.close()


def _trained(tmp_path, steps: int, *options) -> tuple[dict, CheckpointManager]:
    """A fresh state and manager (``_manager(tmp_path, *options)``), restored and trained for steps 0..steps-1."""
    st = _state()
    mgr = _manager(tmp_path, *options)
    mgr.restore(st)
    for step in range(steps):
        _step(st, step)
        mgr.maybe_save(step, st)
    return st, mgr


def _drops_are_errors():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.filterwarnings("error", message=".*ring.*is full.*")
    return w


def test_the_records_a_recovery_listed_are_kept_before_the_auto_ring_is_sized(tmp_path):
    # full checkpoint at 5, records 6..9 in slots 0..3; at the restart the ring is AUTO_MIN (4) until its first
    # record: that record must not drop record 6, which a second crash still needs
    _, mgr = _trained(tmp_path, 10, "auto", 5)
    mgr.close()
    st = _state()
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    assert mgr.restore(st) == 9
    w = _drops_are_errors()
    try:
        for step in (10, 11):
            _step(st, step)
            mgr.maybe_save(step, st)
    finally:
        w.__exit__(None, None, None)
    mgr.close()
    st = _state()
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    assert mgr.restore(st) == 11
    mgr.close()


def test_a_step_taken_before_a_restore_is_not_recorded_with_the_next(tmp_path):
    st, mgr = _trained(tmp_path, 6)
    _step(st, 6)                                        # a step then given up: no maybe_save, a restore instead
    assert mgr.restore(st) == 5
    _step(st, 6)
    mgr.maybe_save(6, st)
    log = mgr._steplog
    slot = next(k for k, v in log.ring.held.items() if v == 6)
    header = read_header(log.root, slot_name(0, slot))
    assert header is not None and len(header.doc["calls"]) == 1
    mgr.close()


def test_a_rollback_not_yet_gone_on_keeps_the_records_after_it(tmp_path):
    # records up to 9 (full checkpoints at 0, 4, 8); restore(step=4), one optimizer step, then a crash before any
    # maybe_save: the rollback never went on, and a restart resumes at 9
    _, mgr = _trained(tmp_path, 10)
    mgr.close()
    st = _state()
    mgr = _manager(tmp_path)
    assert mgr.restore(st, step=4) == 4
    w = _drops_are_errors()
    try:
        _step(st, 5)                                    # (its record takes a slot: not one holding 5..9)
    finally:
        w.__exit__(None, None, None)
    mgr._steplog.close()                                # (a crash: nothing more)
    mgr._steplog = None
    mgr.close()
    st = _state()
    mgr = _manager(tmp_path)
    assert mgr.restore(st) == 9
    mgr.close()


def test_growth_past_the_ring_is_bounded(tmp_path):
    mgr = _manager(tmp_path, 4, 10 ** 6)
    log = mgr._steplog
    log.ring.durable, log.ring.listed = 10, 14
    log.ring.held = {0: 11, 1: 12, 2: 13, 3: 14}                # listed records, still needed: the next goes past
    assert log._free_slot() == 4
    log.ring.held.update({4: 15, 5: 16, 6: 17})                 # this run's own: 3 of 4
    assert log._free_slot() == 7
    log.ring.held[7] = 18                                       # 4 of this run's own (saves failing): drop the oldest
    with pytest.warns(UserWarning, match="ring.*is full"):
        assert log._free_slot() == 0
    log.ring.listed = None
    log.ring.held = {0: 11, 1: 12, 2: 13, 3: 14}                # nothing listed: a full ring drops, as ever
    with pytest.warns(UserWarning, match="ring.*is full"):
        assert log._free_slot() == 0
    mgr.close()


def test_stray_files_in_a_ring_folder_are_left_alone(tmp_path):
    st = _state()
    mgr = _manager(tmp_path, 4, 10 ** 6)
    mgr.restore(st)
    folder = os.path.join(mgr._steplog.root, "r00000")
    os.makedirs(folder, exist_ok=True)
    for name in ("slot-\u00b2", "slot-5", "notes.txt", "slot-00012"):
        with open(os.path.join(folder, name), "w") as f:
            f.write("x")
    for step in range(3):
        _step(st, step)
        mgr.maybe_save(step, st)
    left = set(os.listdir(folder))
    assert {"slot-\u00b2", "slot-5", "notes.txt"} <= left and "slot-00012" in left   # (00012: not a slot name)
    mgr.close()


def test_a_ring_that_does_not_fit_its_share_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(stepplan, "AUTO_SHARE", 1 << 40)       # (a node whose shared memory holds no 4 records)
    from liferaft.tiers import steplog as steplog_mod
    monkeypatch.setattr(steplog_mod, "AUTO_SHARE", 1 << 40)
    mgr = _manager(tmp_path, "auto", 10 ** 6)
    st = _state()
    mgr.restore(st)
    with pytest.warns(UserWarning, match="shared memory"):
        for step in range(3):
            _step(st, step)
            mgr.maybe_save(step, st)
    assert mgr._steplog is not None and mgr._steplog.max_steps == stepplan.AUTO_MIN
    mgr.close()


def test_a_step_log_needs_a_memory_tier(tmp_path):
    with pytest.raises(OptionsError, match="memory tier"):
        CheckpointManager(str(tmp_path / "root"), step_log=StepLogOptions())


def test_resume_past_the_full_checkpoint_is_bitwise(tmp_path):
    ref = _run(tmp_path / "ref", 9)
    _run(tmp_path / "run", 6)               # full checkpoint at 4; records 5, 6 in the log
    st = _state()
    mgr = _manager(tmp_path / "run")
    assert mgr.restore(st) == 6
    assert mgr._steplog is not None and mgr._steplog.last_recovery["full"] == 4
    for step in (7, 8, 9):
        _step(st, step)
        mgr.maybe_save(step, st)
    mgr.close()
    a, b = _tensors(st), _tensors(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert st["seen"] == ref["seen"] and st["sched"].state_dict() == ref["sched"].state_dict()


def test_maybe_save_twice_for_one_step_records_it_once(tmp_path):
    st = _state()
    mgr = _manager(tmp_path)
    mgr.restore(st)
    _step(st, 0)
    mgr.maybe_save(0, st)
    mgr.maybe_save(0, st, force=True)
    log = mgr._steplog
    assert log is not None and sorted(log.ring.held.values()) == [0]
    mgr.close()


def test_a_step_with_a_closure_is_refused(tmp_path):
    st = _state()
    mgr = _manager(tmp_path)
    mgr.restore(st)
    st["model"](torch.randn(3, 4)).sum().backward()
    with pytest.raises(InvalidStateError, match="closure"):
        st["optim"].step(lambda: 0.0)
    mgr.close()


def test_a_sparse_gradient_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    st = {"model": emb, "optim": torch.optim.SGD(emb.parameters(), lr=0.1)}
    mgr = _manager(tmp_path)
    mgr.restore(st)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(InvalidStateError, match="sparse"):          # (a raw RuntimeError from .contiguous() before)
        st["optim"].step()
    mgr.close()


def test_a_full_ring_takes_a_full_checkpoint(tmp_path):
    st = _state()
    mgr = CheckpointManager(str(tmp_path / "root"), every_steps=100,
                            tiers=TierOptions(memory=MemoryTier("unit", node="n0", base=str(tmp_path / "shm")),
                                              memory_every=10 ** 6, drain=False),
                            step_log=StepLogOptions(max_steps=3), async_save=False)
    mgr.restore(st)
    for step in range(8):
        _step(st, step)
        mgr.maybe_save(step, st)
    log = mgr._steplog
    assert log is not None and len(log.held_steps()) <= 3 and all(s > log.durable for s in log.held_steps())
    assert next(i.step for i in mgr.steps()) == 0 and len(mgr.steps()) >= 2      # 0, then forced by the ring
    mgr.close()


def test_half_a_ring_starts_an_async_full_checkpoint_and_the_slots_are_reused(tmp_path):
    """max_steps=8, no interval save for 100 steps: a full checkpoint starts (asynchronously) whenever 4 records
    are newer than the durable one, so a 30-step run never fills the ring, never saves synchronously for it, and
    touches few slot files; the steps saved are the half-ring ones; a resume is still bitwise."""
    st = _state()
    mgr = CheckpointManager(str(tmp_path / "root"), every_steps=100,
                            tiers=TierOptions(memory=MemoryTier("unit", node="n0", base=str(tmp_path / "shm")),
                                              memory_every=10 ** 6, drain=False),
                            step_log=StepLogOptions(max_steps=8), async_save=True)
    mgr.restore(st)
    for step in range(30):
        _step(st, step)
        assert not mgr._steplog.full, step                      # never full: the half-ring saves free it
        mgr.maybe_save(step, st)
    mgr.wait()
    saved = sorted(i.step for i in mgr.steps())
    assert len(saved) >= 4 and saved[0] == 0, saved             # step 0 (the first base), then every few steps
    folder = glob.glob(str(tmp_path / "shm" / "unit" / "n0" / "steplog" / "*" / "r00000"))[0]
    assert len(os.listdir(folder)) <= 8                        # the ring's slots, reused
    mgr.close()
    ref = _state()
    for step in range(30):
        _step(ref, step)
    got = _state()
    resumed = CheckpointManager(str(tmp_path / "root"), every_steps=100,
                                tiers=TierOptions(memory=MemoryTier("unit", node="n0", base=str(tmp_path / "shm")),
                                                  memory_every=10 ** 6, drain=False),
                                step_log=StepLogOptions(max_steps=8), async_save=True)
    assert resumed.restore(got) == 29                           # the last step, replayed from the ring
    resumed.close()
    for k, v in _tensors(ref).items():
        assert torch.equal(v, _tensors(got)[k]), k


def _records(tmp_path) -> list[tuple[str, str]]:
    _run(tmp_path, 6)
    folder = glob.glob(str(tmp_path / "shm" / "unit" / "n0" / "steplog" / "*" / "r00000"))[0]    # steplog/<owner>
    return [(folder, f) for f in sorted(os.listdir(folder)) if read_header(folder, f) is not None]


def test_damaged_records_are_refused_naming_the_file(tmp_path):
    folder, name = _records(tmp_path)[-1]
    h = read_header(folder, name)
    assert h is not None
    good = bytes(read_record(folder, name, h.length))
    where = os.path.join(folder, name)
    positions = sorted(set(range(PROLOGUE)) | set(range(h.header_off, h.length, max(1, (h.length - h.header_off)
                                                                                        // 97))))
    for pos in positions:                                       # every prologue byte, header bytes
        bad = bytearray(good)
        bad[pos] ^= 0x5A
        try:
            got = parse_record(bad, where)
        except CorruptCheckpointError as e:
            assert where in str(e)
            continue
        assert got is None or got.doc == h.doc, pos            # (a zeroed magic: no record)
    for cut in (0, 7, PROLOGUE - 1, PROLOGUE, h.header_off, h.length - 1):
        try:
            got = parse_record(good[:cut], where)
        except CorruptCheckpointError as e:
            assert where in str(e)
            continue
        assert got is None, cut


def test_a_damaged_tensor_is_refused_before_replay(tmp_path):
    from liferaft.tiers.stepplan import verify_record

    folder, name = _records(tmp_path)[-1]
    h = read_header(folder, name)
    assert h is not None
    data = bytearray(read_record(folder, name, h.length))
    verify_record(h, data)
    data[PROLOGUE + 3] ^= 1
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        verify_record(h, data)


def test_public_name():
    assert liferaft.StepLogOptions is StepLogOptions


class _Loads:
    """A stateful object that counts its ``load_state_dict`` calls."""

    def __init__(self) -> None:
        self.n, self.loads = 0, 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.loads = sd["n"], self.loads + 1


def test_recovery_replays_every_record_and_loads_the_rest_once(tmp_path):
    """Records 1..9 past the only full checkpoint (0): nine optimizer steps replayed, the rest of the state (the
    stateful objects, buffers, plain values) loaded once — from the last record — not once per record."""
    ref = _run(tmp_path / "ref", 9)
    st = _state()
    st["counter"] = _Loads()
    mgr = _manager(tmp_path / "run", max_steps=32, every=100)     # (16 records: no half-ring save)
    assert mgr.restore(st) is None
    for step in range(10):
        _step(st, step)
        st["counter"].n = step
        mgr.maybe_save(step, st)
    mgr.close()
    st = _state()
    st["counter"] = _Loads()
    mgr = _manager(tmp_path / "run", max_steps=32, every=100)
    assert mgr.restore(st) == 9
    log = mgr._steplog
    assert log is not None
    rec = log.last_recovery
    assert (rec["full"], rec["replayed_to"], rec["replayed"], rec["rest_loads"]) == (0, 9, 9, 1)
    assert set(rec["timings"]) == {"listing", "fetch", "check", "agree", "replay", "rest", "forget"}
    mgr.close()
    assert st["counter"].loads == 2 and st["counter"].n == 9     # the full checkpoint's load, then the record's
    for k, v in _tensors(ref).items():
        assert torch.equal(v, _tensors(st)[k]), k


def test_first_maybe_save_takes_a_full_checkpoint_when_none_is_durable(tmp_path):
    """With a step log and no full checkpoint to replay onto, the first maybe_save saves one whatever the policy
    says; the records after it then resume at the last step."""
    st = _state()
    tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
    mgr = CheckpointManager(str(tmp_path / "root"), every_steps=1000, tiers=TierOptions(memory=tier,
                            memory_every=10 ** 6, drain=False), step_log=StepLogOptions(max_steps=16),
                            save_policy=liferaft.SavePolicy(at_steps={999}))
    assert mgr.restore(st) is None
    for step in range(1, 6):                # (step 0 would be due by every_steps anyway)
        _step(st, step)
        assert mgr.maybe_save(step, st) == (step == 1)
    mgr.wait()
    assert [i.step for i in mgr.steps()] == [1]
    mgr.close()
    st2 = _state()
    mgr = _manager(tmp_path)
    assert mgr.restore(st2) == 5
    mgr.close()
    for k, v in _tensors(st).items():
        assert torch.equal(v, _tensors(st2)[k]), k


def test_a_save_before_the_first_step_records_no_phantom_step(tmp_path):
    """torch's state-dict helpers run a placeholder step (zero gradients) on an optimizer that never stepped when
    liferaft saves it; the per-step log's hooks are off during liferaft's own saves and loads, so the records hold
    one optimizer call per training step."""
    st = _state()
    mgr = _manager(tmp_path, max_steps=32, every=100)
    mgr.restore(st)
    mgr.save(0, st)                                   # before any optimizer step
    for step in range(1, 5):
        _step(st, step)
        mgr.maybe_save(step, st)
    mgr.close()
    folder = glob.glob(str(tmp_path / "shm" / "unit" / "n0" / "steplog" / "*" / "r00000"))[0]
    calls = []
    for name in sorted(os.listdir(folder)):
        h = read_header(folder, name)
        if h is not None:
            calls.append((h.step, len(h.doc["calls"])))
    assert calls and all(n == 1 for _, n in calls), calls


def test_a_step_whose_record_cannot_be_reserved_still_runs_and_maybe_save_raises(tmp_path):
    """Shared memory too small for a record (here: a file-size limit, which the fallocate meets as EFBIG): the
    optimizer step runs all the same (with several ranks, its peers take theirs: a rank that skipped it would
    train another model), and its ``maybe_save`` raises the FileAccessError naming the slot, once the call has
    taken the full checkpoint the hole asks for; the record keeps no part of it, and a retry of that step records
    nothing (its gradients were never copied); training goes on and a resume is still bitwise."""
    import resource

    from liferaft.errors import FileAccessError

    st = _state()
    mgr = _manager(tmp_path, max_steps=32, every=100)
    mgr.restore(st)
    for step in range(2):              # (step 0's slot is free again once step 0 is durable: step 1 takes it)
        _step(st, step)
        mgr.maybe_save(step, st)
    log = mgr._steplog
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = {k: v.clone() for k, v in _tensors(st).items()}
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))     # (Python ignores SIGXFSZ: EFBIG instead)
    try:
        _step(st, 2)                    # a fresh slot: its first reservation meets the limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not torch.equal(before["m.0.weight"], _tensors(st)["m.0.weight"])      # the optimizer stepped
    with pytest.raises(FileAccessError, match="slot-") as e:
        mgr.maybe_save(2, st)
    assert "still started a save" in str(e.value.__notes__)
    assert log._cur is None and 2 in [i.step for i in mgr.steps() if i.status == "committed"]
    assert not mgr.maybe_save(2, st)    # (a retry: nothing recorded, nothing saved again)
    assert 2 not in log.ring.held.values()
    for step in range(3, 5):
        _step(st, step)
        mgr.maybe_save(step, st)
    mgr.close()
    got = _state()
    resumed = _manager(tmp_path, max_steps=32, every=100)
    assert resumed.restore(got) == 4
    resumed.close()
    assert all(torch.equal(v, _tensors(got)[k]) for k, v in _tensors(st).items())


def test_once_a_full_checkpoint_is_measured_the_next_one_starts_later_than_half_the_ring(tmp_path):
    """max_steps=16: once a full checkpoint has become durable (the first, at step 0), the ring-freeing ones start
    when the free slots fall to twice the records it took to become durable + 3 — later than half the ring when
    saves are quick (here synchronous: durable at once, no record meanwhile) — and the ring never fills. (Nothing
    measured yet: half the ring, test_half_a_ring_... above.)"""
    st = _state()
    mgr = _manager(tmp_path, max_steps=16, every=1000)
    mgr.restore(st)
    for step in range(70):
        _step(st, step)
        assert not mgr._steplog.full, step
        mgr.maybe_save(step, st)
    lag = mgr._steplog.ring.lag
    saved = sorted(i.step for i in mgr.steps())
    gaps = [b - a for a, b in itertools.pairwise(saved)]
    mgr.close()
    assert saved[0] == 0 and lag == 0, (saved, lag)
    assert len(gaps) >= 4 and all(g == 13 for g in gaps), (saved, lag)            # 16 - 3, later than half: 8


def test_removing_the_records_after_a_rollback_stays_inside_the_log(tmp_path):
    """``steplist.remove_after`` removes the node's records newer than the step, and nothing through a link: a
    folder of the log swapped for a link to records elsewhere keeps them (and a linked slot file its target)."""
    st = _state()
    mgr = _manager(tmp_path)
    mgr.restore(st)
    for step in range(6):
        _step(st, step)
        mgr.maybe_save(step, st)
    root = mgr._steplog.root
    mine = sorted(glob.glob(os.path.join(root, "r*", "slot-*")))
    newest = {p: read_header(root, os.path.relpath(p, root)) for p in mine}
    assert any(h is not None and h.step > 2 for h in newest.values())
    outside = tmp_path / "outside"
    outside.mkdir()
    for p in mine:
        with open(p, "rb") as f, open(outside / os.path.basename(p), "wb") as g:
            g.write(f.read())
    os.symlink(outside, os.path.join(root, "r00007"))
    os.symlink(outside / os.path.basename(mine[0]), os.path.join(os.path.dirname(mine[0]), "slot-9999"))
    remove_after(root, 2)
    assert sorted(os.listdir(outside)) == sorted(os.path.basename(p) for p in mine)
    assert os.path.islink(os.path.join(os.path.dirname(mine[0]), "slot-9999"))
    for p, h in newest.items():
        assert os.path.exists(p) == (h is None or h.step <= 2), p
    mgr.close()


@pytest.mark.parametrize("world,rank", [(0, 0), (2, 2), (-1, 0), (True, 0)])
def test_a_record_of_no_world_or_a_rank_outside_it_is_refused(tmp_path, world, rank):
    from liferaft.testing.tamper import rewrite_step_header

    _run(tmp_path, 5)
    path = min(glob.glob(str(tmp_path / "shm" / "**" / "slot-*"), recursive=True))
    root, rel = os.path.dirname(os.path.dirname(path)), os.path.relpath(path, os.path.dirname(os.path.dirname(path)))
    h = read_header(root, rel)
    assert h is not None
    h.doc["world"], h.doc["rank"] = world, rank
    rewrite_step_header(path, h)
    with pytest.raises(CorruptCheckpointError, match="world size|rank"):
        read_header(root, rel)
