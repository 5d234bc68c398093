"""The per-step log under a hostile review (issue 17): a fused optimizer under GradScaler (its grad_scale/found_inf
attributes recorded and replayed), records checked completely before any replay, restore(step=K) exact, gaps in
the chain warned about, two managers sharing a memory tier's namespace kept apart."""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from liferaft import CheckpointManager, JobOptions, MemoryTier, StepLogOptions, TierOptions
from liferaft.errors import CorruptCheckpointError


def _manager(path, job: str = "unit", every: int = 4) -> CheckpointManager:
    tier = MemoryTier(job, node="n0", base=str(path / "shm"))
    return CheckpointManager(str(path / "root"), every_steps=every,
                             tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                             step_log=StepLogOptions(replicas=1, max_steps=16), async_save=False)


def _plain() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


def _plain_step(st: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    st["model"](torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    st["optim"].step()
    st["optim"].zero_grad()
    st["sched"].step()


def _fused_amp(inf_steps: bool) -> tuple[Callable[[], dict], Callable[[dict, int], None]]:
    def make() -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return {"model": model, "optim": opt,
                "scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)}

    def step_fn(st: dict, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        loss = st["model"](torch.randn(5, 4, generator=g)).pow(2).mean()
        if inf_steps and step % 3 == 1:
            loss = loss * float("inf")          # GradScaler skips this step (found_inf set on the optimizer)
        st["scaler"].scale(loss).backward()
        if inf_steps:
            st["scaler"].unscale_(st["optim"])  # grad_scale then None
        st["scaler"].step(st["optim"])
        st["scaler"].update()
        st["optim"].zero_grad()
    return make, step_fn


def _train(path, make, step_fn, last: int, skip: tuple[int, ...] = ()) -> tuple[dict, CheckpointManager]:
    st = make()
    mgr = _manager(path)
    start = mgr.restore(st)
    for step in range(0 if start is None else start + 1, last + 1):
        step_fn(st, step)
        if step not in skip:
            mgr.maybe_save(step, st)
    return st, mgr


def _same(a: dict, b: dict) -> bool:
    ta = {**a["model"].state_dict(), **{f"o{i}{k}": v for i, s in a["optim"].state_dict()["state"].items()
                                      for k, v in s.items()}}
    tb = {**b["model"].state_dict(), **{f"o{i}{k}": v for i, s in b["optim"].state_dict()["state"].items()
                                      for k, v in s.items()}}
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _records(path) -> list[tuple[str, Any]]:
    """(file, header) of every step record of the unit tests' memory tier under ``path`` (read and checked)."""
    from liferaft.tiers.steprecord import read_header

    folder = glob.glob(str(path / "shm" / "unit" / "n0" / "steplog" / "*"))[0]      # steplog/<owner>
    out = []
    for d in sorted(x for x in os.listdir(folder) if os.path.isdir(os.path.join(folder, x))):
        for f in sorted(os.listdir(os.path.join(folder, d))):
            h = read_header(folder, f"{d}/{f}")
            if h is not None:
                out.append((os.path.join(folder, d, f), h))
    return out


@pytest.mark.parametrize("inf_steps", [True, False], ids=["skipped-inf-steps", "scaled-grads"])
def test_fused_optimizer_under_grad_scaler_resumes_bitwise(tmp_path, inf_steps):
    make, step_fn = _fused_amp(inf_steps)
    ref, m = _train(tmp_path / "ref", make, step_fn, 7)
    m.close()
    _, m = _train(tmp_path / "run", make, step_fn, 7)
    m.close()
    st = make()
    mgr = _manager(tmp_path / "run")
    assert mgr.restore(st) == 7
    assert mgr._steplog is not None and mgr._steplog.last_recovery["full"] == 4
    assert _same(st, ref) and all(torch.isfinite(p).all() for p in st["model"].parameters())
    assert st["scaler"].state_dict() == ref["scaler"].state_dict()
    assert not hasattr(st["optim"], "grad_scale") and not hasattr(st["optim"], "found_inf")
    mgr.close()


def _snap(st: dict) -> dict:
    return {k: v.clone() for k, v in st["model"].state_dict().items()}


def test_restore_of_an_explicit_step_replays_nothing_and_keeps_the_newer_records(tmp_path):
    st, mgr = _train(tmp_path, _plain, _plain_step, 0)
    at0 = _snap(st)
    for step in range(1, 10):
        _plain_step(st, step)
        mgr.maybe_save(step, st)
    mgr.close()                                 # full checkpoints 0, 4, 8; records up to 9
    st = _plain()
    mgr = _manager(tmp_path)
    assert mgr.restore(st, step=0) == 0
    assert all(torch.equal(v, at0[k]) for k, v in _snap(st).items())
    mgr.close()
    st = _plain()
    mgr = _manager(tmp_path)
    assert mgr.restore(st) == 9                 # the newer records were kept
    mgr.close()


def test_the_first_step_after_an_explicit_restore_drops_the_old_future(tmp_path):
    st, mgr = _train(tmp_path, _plain, _plain_step, 3)       # full checkpoint 0, records 1..3
    ref_mgr = mgr
    assert mgr.restore(st, step=0) == 0         # the same manager: its slot files are open
    _plain_step(st, 1)
    mgr.maybe_save(1, st)
    log = mgr._steplog
    assert log is not None
    for rel, f in log._files.items():           # none open on a removed file
        assert os.stat(os.path.join(log.root, rel)).st_ino == os.fstat(f.fd).st_ino, rel
    mgr.close()
    st = _plain()
    mgr = _manager(tmp_path)
    assert mgr.restore(st) == 1                 # not the stale 2, 3 of the old future
    assert ref_mgr is not mgr
    mgr.close()


def _forge(doc: dict, how: str) -> None:
    call = doc["calls"][0]
    first_rest = min(doc["rest"]["tensors"])
    if how == "optimizer-index":
        call["opt"] = 5
    elif how == "grad-shape":
        call["grads"][0]["shape"] = [32]                # the same bytes as the [8, 4] weight
    elif how == "grad-dtype":
        call["grads"][0]["dtype"] = "int32"
    elif how == "grads-missing":
        call["grads"].pop()
    elif how == "groups-extra":
        call["groups"].append(dict(call["groups"][0]))
    elif how == "hyper-type":
        call["groups"][0]["lr"] = "x"
    elif how == "hyper-unknown":
        call["groups"][0]["bogus"] = 1
    elif how == "kwargs":
        call["kwargs"] = {"bogus": 1}
    elif how == "attrs":
        call["attrs"] = {"__class__": None}
    elif how == "call-malformed":
        doc["calls"][0] = [1, 2]
    elif how == "rest-missing":
        doc["rest"]["tensors"].pop(first_rest)
    elif how == "rest-shape":
        doc["rest"]["tensors"][first_rest][0]["shape"] = [1, 1]
    elif how == "hyper-huge":                           # of a number's kind, too large for torch's float
        call["groups"][0]["lr"] = 10 ** 400
    elif how in ("hyper-amsgrad", "hyper-capturable", "hyper-foreach"):     # a flag fixed when the optimizer was made
        call["groups"][0][how.removeprefix("hyper-")] = True
    elif how == "rest-groups":
        doc["rest"]["values"]["optim.param_groups"] = 5
    elif how == "rest-groups-params":
        doc["rest"]["values"]["optim.param_groups"][0]["params"] = []


@pytest.mark.parametrize("how", ["optimizer-index", "grad-shape", "grad-dtype", "grads-missing", "groups-extra",
                                 "hyper-type", "hyper-unknown", "kwargs", "attrs", "call-malformed", "rest-missing",
                                 "rest-shape", "hyper-huge", "hyper-amsgrad", "hyper-capturable", "hyper-foreach",
                                 "rest-groups", "rest-groups-params"])
def test_a_record_that_does_not_fit_stops_the_replay_before_it(tmp_path, how):
    from liferaft.testing.tamper import rewrite_step_header

    ref, m = _train(tmp_path / "ref", _plain, _plain_step, 5)
    m.close()
    _, m = _train(tmp_path / "run", _plain, _plain_step, 7)          # full 4, records 5, 6, 7
    m.close()
    forged = None
    for path, h in _records(tmp_path / "run"):
        if h.step != 6:
            continue
        _forge(h.doc, how)                  # valid checksums, contents that do not fit the live state
        rewrite_step_header(path, h)
        forged = path
    assert forged is not None
    st = _plain()
    mgr = _manager(tmp_path / "run")
    with pytest.warns(UserWarning, match="resumes at step 5") as caught:
        assert mgr.restore(st) == 5
    assert any(forged in str(w.message) for w in caught)
    assert _same(st, ref) and st["sched"].state_dict() == ref["sched"].state_dict()
    mgr.close()


def test_a_step_without_maybe_save_is_warned_about_when_written_and_when_recovered(tmp_path):
    ref, m = _train(tmp_path / "ref", _plain, _plain_step, 5)
    m.close()
    st = _plain()
    mgr = _manager(tmp_path / "run")
    assert mgr.restore(st) is None
    for step in range(7):
        _plain_step(st, step)
        if step != 6:
            mgr.maybe_save(step, st)
    _plain_step(st, 7)
    with pytest.warns(UserWarning, match="maybe_save was not called for step 6"):
        mgr.maybe_save(7, st)               # the record of 7 holds the optimizer steps of 6 and 7
    mgr.close()
    st = _plain()
    mgr = _manager(tmp_path / "run")
    with pytest.warns(UserWarning, match=r"resumes at step 5 .*record of step 6 .*up to step 7"):
        assert mgr.restore(st) == 5
    assert _same(st, ref)
    mgr.close()


def test_two_managers_sharing_a_memory_tier_namespace_keep_their_logs_apart(tmp_path):
    from liferaft.errors import CheckpointBusyError

    def train(st: dict, step: int, seed: int) -> None:
        g = torch.Generator().manual_seed(step * 1000 + seed)
        st["model"](torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        st["optim"].step()
        st["optim"].zero_grad()

    def manager(name: str) -> CheckpointManager:      # the same MemoryTier job id and base, another root
        tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
        return CheckpointManager(str(tmp_path / name), every_steps=4,
                                 tiers=TierOptions(memory=tier, memory_every=10 ** 6, drain=False),
                                 step_log=StepLogOptions(replicas=1, max_steps=16), async_save=False,
                                 job=JobOptions(lease_ttl=5.0))     # (the refused one waits 5 s, not 30; a
                                                                    # shorter lease can go stale on a loaded machine)

    refs = {"a": _plain(), "b": _plain()}
    for step in range(7):
        train(refs["a"], step, 1)
        train(refs["b"], step, 2)
    sts = {"a": _plain(), "b": _plain()}
    mgrs = {"a": manager("a"), "b": manager("b")}
    with pytest.raises(CheckpointBusyError):
        manager("a")                            # a second live manager of a's root (its lease)
    for name, m in mgrs.items():
        m.restore(sts[name])
    for step in range(7):                       # interleaved: full checkpoints 0, 4; records 5, 6 of each
        for name, seed in (("a", 1), ("b", 2)):
            train(sts[name], step, seed)
            mgrs[name].maybe_save(step, sts[name])
    for m in mgrs.values():
        m.close()
    for name in ("a", "b"):
        st = _plain()
        m = manager(name)
        assert m.restore(st) == 6
        assert _same(st, refs[name]), name
        m.close()


def test_a_second_live_writer_of_one_step_log_is_refused(tmp_path):
    from liferaft.errors import CheckpointBusyError
    from liferaft.tiers.steplog import StepLog

    tier = MemoryTier("unit", node="n0", base=str(tmp_path / "shm"))
    log = StepLog(tier, replicas=1, max_steps=4, owner="file:///a")
    with pytest.raises(CheckpointBusyError, match="another live manager"):
        StepLog(tier, replicas=1, max_steps=4, owner="file:///a")
    other = StepLog(tier, replicas=1, max_steps=4, owner="file:///b")      # another root: another namespace
    assert other.root != log.root
    other.close()
    log.close()
    StepLog(tier, replicas=1, max_steps=4, owner="file:///a").close()     # free again once closed


def test_held_gradient_copies_merge_only_runs_laid_out_alike():
    """stepsend._runs: copies whose source and destination keep the same distance and follow each other (gaps of at
    most 4 KiB between them) become one; anything else stays apart; nothing is lost or overlapped."""
    from liferaft.tiers.stepsend import _runs

    alike = [(64 + i * 128, 64 + i * 128, 100) for i in range(5)]          # DDP: the same layout in both records
    assert _runs(alike) == [(64, 64, 4 * 128 + 100)]
    shifted = [(64, 64, 100), (192, 256, 100)]                                # another distance: two copies
    assert _runs(shifted) == shifted
    far = [(64, 64, 100), (64 + 100 + 8192, 64 + 100 + 8192, 50)]            # a gap too big to copy over
    assert _runs(far) == far
    unordered = [(500, 500, 10), (64, 64, 100)]
    assert _runs(unordered) == [(64, 64, 446)]
    covered = set()
    for s, d, n in _runs(alike):
        covered |= set(range(d, d + n))
    assert all(set(range(d, d + n)) <= covered for _, d, n in alike)


def test_a_gradient_with_the_same_crc_but_other_bytes_is_sent_not_taken_from_home(tmp_path):
    """Replication decides "the receiver holds this gradient" on a 64-bit digest of the bytes, never on the
    record's 32-bit CRC-32C: two float32 gradients built to share their CRC-32C are told apart and the sender's
    bytes are sent."""
    import crc32c

    from liferaft.codecs.checksum import CHECKSUM_BITS
    from liferaft.tiers.steprecord import PROLOGUE, RECORD_CHECKSUM, as_bytes, tensor_entry
    from liferaft.tiers.stepsend import Sender, _rows
    from liferaft.tiers.stepslot import Slot

    n = 64
    c0 = crc32c.crc32c(bytes(n))
    basis: dict[int, tuple[int, int]] = {}
    combo = 0
    for i in range(40):                   # a nonzero difference D with CRC(x ^ D) == CRC(x) (CRC is affine)
        b = bytearray(n)
        b[8 + i // 8] |= 1 << (i % 8)
        v, m = crc32c.crc32c(bytes(b)) ^ c0, 1 << i
        while v:
            hb = v.bit_length() - 1
            if hb not in basis:
                basis[hb] = (v, m)
                break
            v, m = v ^ basis[hb][0], m ^ basis[hb][1]
        if v == 0:
            combo = m
            break
    assert combo
    diff = bytearray(n)
    for i in range(40):
        if combo >> i & 1:
            diff[8 + i // 8] ^= 1 << (i % 8)
    sender = torch.randn(n // 4, generator=torch.Generator().manual_seed(1))
    receiver = torch.frombuffer(bytearray(a ^ b for a, b in zip(as_bytes(sender).tobytes(), diff)), dtype=torch.float32)
    e_s, e_r = tensor_entry(PROLOGUE, sender, as_bytes(sender)), tensor_entry(PROLOGUE, receiver, as_bytes(receiver))
    assert CHECKSUM_BITS[RECORD_CHECKSUM] == 64 and e_s["digest"] != e_r["digest"]   # records: 64-bit digests
    for e, t in ((e_s, sender), (e_r, receiver)):       # a record with CRC-32C entries (any algorithm reads)
        e["digest"] = f"{crc32c.crc32c(as_bytes(t)):08x}"
    assert e_s["digest"] == e_r["digest"] and not torch.equal(sender, receiver)      # the CRCs collide
    length = PROLOGUE + n + 64
    records = {}
    for name, t in (("snd", sender), ("rcv", receiver)):
        records[name] = Slot(str(tmp_path), name)
        records[name].reserve(length)
        records[name].write(PROLOGUE, as_bytes(t))
    theirs = _rows([e_s], memoryview(records["snd"].map)[:length], "crc32c").tolist()
    rows = _rows([e_r], memoryview(records["rcv"].map)[:length], "crc32c").tolist()
    snd = Sender(str(tmp_path), None, 1, [], [0], lambda r, s: f"rep-{r}-{s}", lambda rel, size: records["rcv"])
    assert snd._mask(0, 5, length, theirs, 5, rows) == [0]                   # sent, not taken from home
    fresh = Sender(str(tmp_path), None, 1, [], [0], lambda r, s: f"rep-{r}-{s}", lambda rel, size: records["snd"])
    assert fresh._mask(0, 5, length, theirs, 5, theirs) == [1]              # the same bytes: kept home


def test_a_slot_never_shrinks_when_two_threads_reserve_it(tmp_path):
    """The training thread and the replication thread both reserve slots: a smaller reservation landing after a
    bigger one leaves the bigger mapping (it once shrank it under the writer)."""
    import threading

    from liferaft.tiers.stepslot import Slot

    slot = Slot(str(tmp_path), "s")
    slot.reserve(3 << 20)
    sizes = [(1 + i % 7) << 20 for i in range(64)]
    threads = [threading.Thread(target=slot.reserve, args=(s,)) for s in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slot.capacity >= max(sizes) and len(slot.map) == slot.capacity
    slot.write(slot.capacity - 4, b"abcd")
    slot.close()


@pytest.mark.parametrize("head", [(0, 1, -1, 2), (0, 1, (1 << 62), 2), (0, 1, 100, (1 << 40)), (-1, 1, 100, 2),
                                  (0, 1, 100, -5), (0, 1, 63, 0), (0, 1, 0, 2)])
def test_an_absurd_announcement_from_a_peer_is_refused_before_anything_is_allocated(head):
    """stepsend._announced: a peer's (slot, step, length, gradients) outside the record limits raises
    DistributedError naming the peer (a LiferaftError, not a bare OSError), before rows are allocated for it; a
    length shorter than a prologue is no record, unless it is 0 with no gradients (the peer has none of the step)."""
    from liferaft.errors import DistributedError, LiferaftError
    from liferaft.tiers.stepsend import _announced

    with pytest.raises(DistributedError, match="rank 3 announced") as err:
        _announced(3, torch.tensor(head, dtype=torch.int64))
    assert isinstance(err.value, LiferaftError)
    assert _announced(3, torch.tensor([0, 1, 100, 2], dtype=torch.int64)) == 2
    assert _announced(3, torch.tensor([0, -1, 0, 0], dtype=torch.int64)) == 0     # no record there (Sender.skip)


def test_a_record_a_few_bytes_longer_than_the_last_fits_its_slot_without_doubling_it(tmp_path):
    """A header grows by a few bytes from one step to the next (a step's digits, a learning rate's repr): the slot
    keeps its mapping; a fresh slot filled tensor by tensor still grows by doubling (few mappings)."""
    from liferaft.tiers.stepslot import Slot

    slot = Slot(str(tmp_path), "s")
    slot.reserve(13_743_315, whole=True)                 # the next record's slot, reserved ahead
    cap, mapping = slot.capacity, slot.map
    slot.reserve(13_743_319)                             # the record, a few bytes longer
    assert slot.capacity == cap < 14 << 20 and slot.map is mapping
    for step in (4 << 10, 60 << 10, 256 << 10):          # appended in small or larger tensors: doubling
        fresh = Slot(str(tmp_path), f"f{step}")
        sizes = []
        for end in range(64, 13 << 20, step):
            fresh.reserve(end)
            sizes.append(fresh.capacity)
        assert len(set(sizes)) <= 6 and fresh.capacity < 2 * (13 << 20), (step, len(set(sizes)))
        fresh.close()
    slot.close()


def _large() -> dict:
    torch.manual_seed(0)
    # gradients of 2.0 and 1.1 MB (copied and hashed piece by piece, the last piece short) beside small ones; a
    # transposed weight (a non-contiguous gradient, made contiguous first)
    model = nn.Sequential(nn.Linear(1000, 520), nn.Linear(520, 520), nn.Linear(520, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt}


def _large_step(st: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    st["model"](torch.randn(3, 1000, generator=g)).pow(2).mean().backward()
    w = st["model"][1].weight
    w.grad = w.grad.t().contiguous().t()            # (same values, a non-contiguous layout)
    st["optim"].step()
    st["optim"].zero_grad()


@pytest.mark.parametrize("damage", [False, True], ids=["whole", "a-byte-flipped-in-a-large-gradient"])
def test_large_gradients_are_recorded_exactly_and_verified(tmp_path, damage):
    """Gradients of 1 MiB and more are copied into the slot and hashed piece by piece: a resume replays them
    bitwise; one byte changed inside such a gradient is caught by its checksum (the replay stops before it)."""
    ref, m = _train(tmp_path / "ref", _large, _large_step, 5 if damage else 7)
    m.close()
    _, m = _train(tmp_path / "run", _large, _large_step, 7)          # full 4, records 5, 6, 7
    m.close()
    if damage:
        hit = None
        for path, h in _records(tmp_path / "run"):
            if h.step != 6:
                continue
            big = max((g for c in h.doc["calls"] for g in c["grads"] if g), key=lambda g: g["len"])
            assert big["len"] >= 1 << 20
            with open(path, "r+b") as f:
                f.seek(big["off"] + big["len"] - 3)         # in the last piece
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0x10]))
            hit = path
        assert hit is not None
    st = _large()
    mgr = _manager(tmp_path / "run")
    if damage:
        with pytest.warns(UserWarning, match="resumes at step 5"):
            assert mgr.restore(st) == 5
    else:
        assert mgr.restore(st) == 7
    assert _same(st, ref)
    mgr.close()


def test_the_spans_sent_ignore_a_held_mark_on_a_row_without_a_gradient():
    """A peer's mask marking a row that has no gradient (-1s: the parameter had none) as held must not shift the
    spans sent: every byte of the record outside the truly held gradients is still sent, from offset 0."""
    from liferaft.tiers.stepsend import _ranges

    rows = [[-1, -1, -1, -1], [128, 64, 1, 2], [192, 64, 3, 4]]
    assert _ranges(320, rows, [1, 1, 0]) == [(0, 128), (192, 128)]
    assert _ranges(320, rows, [1, 0, 0]) == [(0, 320)]
    assert _ranges(320, rows, [0, 0, 1]) == [(0, 192), (256, 64)]


def test_a_stateless_optimizers_record_holds_its_own_step_only(tmp_path):
    """Walking the rest of the state with torch's helpers runs a placeholder step (lr 0, zero gradients) on an
    optimizer without state (plain SGD); the hooks are off for it: each record holds the training's one call, not
    a second one with twice the gradient bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    st = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01)}
    mgr = _manager(tmp_path)
    mgr.restore(st)
    for step in range(4):
        model(torch.randn(5, 16)).pow(2).mean().backward()
        st["optim"].step()
        st["optim"].zero_grad()
        mgr.maybe_save(step, st)
    mgr.close()
    calls = {h.step: [c["groups"][0]["lr"] for c in h.doc["calls"]] for _, h in _records(tmp_path)}
    assert calls and all(v == [0.01] for v in calls.values()), calls


def test_records_after_a_rollback_below_the_newest_full_checkpoint_are_kept_until_a_newer_one(tmp_path):
    """restore(step=K) below the newest durable full checkpoint D (which the rollback removes): the records this
    run then makes (K+1 ... past D) are not covered by D, so none may take another's slot; a restart replays them
    all (their slots were once reused as if D still stood, and a restart resumed at K)."""
    st, mgr = _plain(), _manager(tmp_path, every=10 ** 6)     # (full checkpoints only where saved below)
    mgr.restore(st)
    for step in range(6):
        _plain_step(st, step)
        mgr.maybe_save(step, st)
    mgr.save(5, st)
    for step in range(6, 11):
        _plain_step(st, step)
        mgr.maybe_save(step, st)
    mgr.save(10, st)
    assert mgr.restore(st, step=5) == 5
    for step in range(6, 12):
        _plain_step(st, step)
        mgr.maybe_save(step, st)
    ref = {k: v.clone() for k, v in st["model"].state_dict().items()}
    log = mgr._steplog
    assert log is not None and log.held_steps() == list(range(6, 12))
    mgr.close()
    st = _plain()
    mgr = _manager(tmp_path, every=10 ** 6)
    assert mgr.restore(st) == 11
    assert all(torch.equal(v, ref[k]) for k, v in st["model"].state_dict().items())
    mgr.close()


class _Counter:
    """A user's stateful object whose ``load_state_dict`` refuses what it never saved (a negative count)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        if sd["n"] < 0:
            raise ValueError(f"a count of {sd['n']}")
        self.n = sd["n"]


def _counted() -> dict:
    return {**_plain(), "count": _Counter()}


def _counted_step(st: dict, step: int) -> None:
    _plain_step(st, step)
    st["count"].n += 1


def test_a_record_whose_replay_fails_after_its_checks_is_removed_and_named_on_every_rank(tmp_path):
    """What no check can see (a user object refusing a value in its load_state_dict, a torch error in a replayed
    step): the replay raises a CorruptCheckpointError naming the step, with the records from it removed, so a
    restore again resumes before it, bit for bit."""
    from liferaft.testing.tamper import rewrite_step_header

    ref, m = _train(tmp_path / "ref", _counted, _counted_step, 6)
    m.close()
    _, m = _train(tmp_path / "run", _counted, _counted_step, 7)     # full 4, records 5, 6, 7
    m.close()
    for path, h in _records(tmp_path / "run"):
        if h.step == 7:
            key = next(k for k in h.doc["rest"]["values"] if k.startswith("count"))
            h.doc["rest"]["values"][key] = -3
            rewrite_step_header(path, h)
    st = _counted()
    mgr = _manager(tmp_path / "run")
    with pytest.raises(CorruptCheckpointError, match=r"step 7.*a count of -3.*state anew.*resumes at step 6"):
        mgr.restore(st)
    st = _counted()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # (nothing left to warn of: the records end at 6)
        assert mgr.restore(st) == 6
    assert _same(st, ref) and st["count"].n == ref["count"].n == 7
    _counted_step(st, 7)                # (the state made anew is the one hooked: its step is recorded)
    mgr.maybe_save(7, st)
    mgr.close()
    ref7, m = _train(tmp_path / "ref7", _counted, _counted_step, 7)
    m.close()
    st = _counted()
    mgr = _manager(tmp_path / "run")
    assert mgr.restore(st) == 7
    assert _same(st, ref7) and st["count"].n == 8
    mgr.close()
