"""The per-step log (docs/STEPLOG.md): a run killed by SIGKILL resumes from the last completed step, not the last
full checkpoint, bitwise equal to an uninterrupted run — DDP and FSDP2, AdamW and SGD, two micro-batches, a
GradScaler that skips a step, an LR scheduler; the loss of a node's memory costs at most one step; another world
size falls back to the full checkpoint; a damaged record stops the replay before it; retention frees records."""

from __future__ import annotations

import glob
import os
import shutil
import warnings

import pytest
from multiproc._steplog_ranks import job, replay_alone

from liferaft.testing import RankFailure, run_ranks

LAST, KILL = 11, 7          # full checkpoints at 0, 4, 8: the kill at 7 is 3 steps past the newest (4)


def _equal(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and every byte; plain values: their repr)."""
    return [k for k in a if k not in b or a[k] != b[k]] + [k for k in b if k not in a]


def _reference(tmp_path, kind, opt):
    return run_ranks(job, 2, str(tmp_path / "ref"), str(tmp_path / "ref-shm"), kind, opt, LAST, None, timeout=180)


def _crash(tmp_path, kind, opt, kill=KILL):
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    with pytest.raises(RankFailure):
        run_ranks(job, 2, root, base, kind, opt, LAST, kill, timeout=180)
    return root, base


def _check_resumed(out, ref, start):
    for rank in range(2):
        assert out[rank]["start"] == start, out[rank]["recovery"]
        assert out[rank]["recovery"]["full"] == 4
        for step, loss in out[rank]["losses"].items():     # the losses after the resume, bit for bit
            assert loss == ref[rank]["losses"][step], (rank, step)
        assert not _equal(out[rank]["state"], ref[rank]["state"]), _equal(out[rank]["state"], ref[rank]["state"])


@pytest.mark.parametrize("kind,opt", [("ddp", "adamw"), ("ddp", "sgd"), ("fsdp", "adamw"), ("fsdp", "sgd")])
def test_kill_9_resumes_from_the_last_step_bitwise(tmp_path, kind, opt):
    ref = _reference(tmp_path, kind, opt)
    root, base = _crash(tmp_path, kind, opt)
    out = run_ranks(job, 2, root, base, kind, opt, LAST, None, timeout=180)
    _check_resumed(out, ref, KILL)          # no step lost: the log held 5, 6, 7 past the full checkpoint 4


def test_lost_node_memory_resumes_from_the_peer_replica(tmp_path):
    ref = _reference(tmp_path, "ddp", "adamw")
    root, base = _crash(tmp_path, "ddp", "adamw")
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))      # rank 1's node lost its memory
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, timeout=180)
    assert out[0]["start"] in (KILL - 1, KILL), out[0]["recovery"]  # at most one step lost
    assert out[1]["recovery"]["fetched"] >= 1
    _check_resumed(out, ref, out[0]["start"])


def test_kill_9_before_the_first_interval_save_resumes_at_the_last_step(tmp_path):
    """No interval save before the kill: the manager took a full checkpoint at the first maybe_save (step 0) by
    itself, so the records 1..KILL replay onto it — no step lost, bitwise."""
    ref = run_ranks(job, 2, str(tmp_path / "ref"), str(tmp_path / "ref-shm"), "ddp", "adamw", LAST, None, 64,
                    True, None, timeout=180)
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    with pytest.raises(RankFailure):
        run_ranks(job, 2, root, base, "ddp", "adamw", LAST, KILL, 64, True, None, timeout=180)
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, 64, True, None, timeout=180)
    for rank in range(2):
        assert out[rank]["start"] == KILL, out[rank]["recovery"]
        assert out[rank]["recovery"]["full"] == 0 and out[rank]["recovery"]["replayed"] == KILL
        assert out[rank]["recovery"]["rest_loads"] == 1
        for step, loss in out[rank]["losses"].items():
            assert loss == ref[rank]["losses"][step], (rank, step)
        assert not _equal(out[rank]["state"], ref[rank]["state"]), _equal(out[rank]["state"], ref[rank]["state"])


@pytest.mark.parametrize("kind", ["ddp", "mixed"])
def test_replicated_gradients_are_not_sent_and_a_lost_node_still_recovers_bitwise(tmp_path, kind):
    """DDP gradients are the same bytes on both ranks: the peer's replica takes them from its own record instead
    of the wire. ``mixed``: a part of the model each rank trains on its own data (its gradients differ between
    the ranks, found by their checksums): those are sent in full, and rank 1's records rebuilt on rank 0's node
    still replay bitwise after rank 1's node lost its memory."""
    ref = _reference(tmp_path, kind, "sgd")
    root, base = _crash(tmp_path, kind, "sgd")
    lost, peer = (glob.glob(os.path.join(base, "steplog-test", node, "steplog", "*", "r00001"))[0]
                  for node in ("node1", "node0"))
    same = _same_records(lost, peer)            # rank 1's records as its node wrote them = its replicas
    assert len(same) >= 3, same
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))
    with warnings.catch_warnings(record=True):
        out = run_ranks(job, 2, root, base, kind, "sgd", LAST, None, timeout=180)
    assert out[0]["start"] in (KILL - 1, KILL), out[0]["recovery"]
    why = out[1]["recovery"]["why"]                 # (at most the record in flight at the kill is missing)
    assert out[1]["recovery"]["fetched"] >= 1 and "refused" not in why and "checksum" not in why, why
    _check_resumed(out, ref, out[0]["start"])
    for rank in range(2):
        assert out[rank]["unsent"] > 0                      # the DDP gradients stayed home
        assert (out[rank]["diverged"] > 0) == (kind == "mixed"), out[rank]


def _same_records(a: str, b: str) -> list[int]:
    """Steps whose record is held in both slot folders, checked byte for byte equal (the replica is the record)."""
    from liferaft.tiers.steprecord import read_header, read_record

    out = []
    for name in sorted(os.listdir(b)):
        ha, hb = read_header(a, name), read_header(b, name)
        if ha is not None and hb is not None and ha.step == hb.step:
            assert read_record(a, name, ha.length) == read_record(b, name, hb.length), name
            out.append(hb.step)
    return out


def test_another_world_size_falls_back_to_the_full_checkpoint(tmp_path):
    root, base = _crash(tmp_path, "ddp", "adamw")
    out = run_ranks(job, 1, root, base, "ddp", "adamw", 4, None, 64, False, timeout=180)
    assert out[0]["start"] == 4 and "world size" in out[0]["recovery"]["why"], out[0]["recovery"]


def _damage(path, damage):
    from liferaft.tiers.steprecord import read_header

    h = read_header(os.path.dirname(path), os.path.basename(path))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[100] ^= 0xFF                               # a gradient byte
    elif damage == "truncate":
        data = data[:h.header_off - 10]
    else:
        data[h.header_off + 5] ^= 0x01                  # the header
    with open(path, "wb") as f:
        f.write(data)


def _slot_of(folder, step):
    from liferaft.tiers.steprecord import read_header

    return next(os.path.join(folder, f) for f in sorted(os.listdir(folder))
                if (h := read_header(folder, f)) is not None and h.step == step)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "flip-own-copy-only"])
def test_a_damaged_record_stops_the_replay_before_it(tmp_path, damage):
    """Rank 1's record of step 6 damaged on its node and on its replica's: the replay stops at 5 (never a wrong
    state); damaged on its own node only: the replica's copy is taken and nothing is lost."""
    ref = _reference(tmp_path, "ddp", "adamw")
    root, base = _crash(tmp_path, "ddp", "adamw")
    copies = ["node1"] if damage.endswith("only") else ["node1", "node0"]
    for node in copies:
        _damage(_slot_of(glob.glob(os.path.join(base, "steplog-test", node, "steplog", "*", "r00001"))[0], 6), damage.split("-")[0])
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, timeout=180)
    _check_resumed(out, ref, KILL if damage.endswith("only") else 5)
    if not damage.endswith("only") and damage == "flip":
        assert "slot-" in out[0]["recovery"]["why"] + out[1]["recovery"]["why"]     # names the file


def test_retention_frees_records_once_a_full_checkpoint_is_durable(tmp_path):
    out = run_ranks(job, 2, str(tmp_path / "r"), str(tmp_path / "shm"), "ddp", "sgd", 10, None, 3, timeout=180)
    for rank in range(2):
        # full checkpoints at 0, 4, 8 (and whenever the 3-slot ring filled): nothing at or below the durable step
        assert all(s > out[rank]["durable"] for s in out[rank]["held"]), out[rank]
        assert len(out[rank]["held"]) <= 3
    slots = os.listdir(glob.glob(os.path.join(str(tmp_path / "shm"), "steplog-test", "node0", "steplog", "*", "r00000"))[0])
    assert len(slots) <= 3


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_replay_makes_no_collective_under_fsdp2(opt):
    assert run_ranks(replay_alone, 2, opt, timeout=60, pg_timeout=20) == [True, True]
