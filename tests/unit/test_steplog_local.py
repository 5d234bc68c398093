"""The per-step log in one process: options, a resume past the full checkpoint bit for bit, a step with a closure
refused, and step records read as hostile input (every truncation and damaged byte is a CorruptCheckpointError
naming the file, or no record — never another exception, never a wrong record)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import liferaft
from liferaft import CheckpointManager, MemoryTier, StepLogOptions, TierOptions
from liferaft.errors import CorruptCheckpointError, InvalidStateError, OptionsError
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


def _manager(tmp_path, max_steps: int = 16) -> CheckpointManager:
    tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
    return CheckpointManager(str(tmp_path / "root"), every_steps=4,
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


@pytest.mark.parametrize("bad", [{"replicas": -1}, {"max_steps": 1}, {"replicas": True}, {"max_steps": 2.5}])
def test_options_are_checked(bad):
    with pytest.raises(OptionsError):
        StepLogOptions(**bad)


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
    assert log is not None and sorted(log._held.values()) == [0]
    mgr.close()


def test_a_step_with_a_closure_is_refused(tmp_path):
    st = _state()
    mgr = _manager(tmp_path)
    mgr.restore(st)
    st["model"](torch.randn(3, 4)).sum().backward()
    with pytest.raises(InvalidStateError, match="closure"):
        st["optim"].step(lambda: 0.0)
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


def _records(tmp_path) -> list[tuple[str, str]]:
    _run(tmp_path, 6)
    folder = str(tmp_path / "shm" / "unit" / "n0" / "steplog" / "r00000")
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
    from liferaft.tiers.steplog import _verify

    folder, name = _records(tmp_path)[-1]
    h = read_header(folder, name)
    assert h is not None
    data = bytearray(read_record(folder, name, h.length))
    _verify(h, data)
    data[PROLOGUE + 3] ^= 1
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        _verify(h, data)


def test_public_name():
    assert liferaft.StepLogOptions is StepLogOptions
