"""Bad input on one rank of two: every rank raises a LiferaftError (the others a DistributedError naming the
failed rank; where every rank finds the fault itself, a damaged manifest, each raises its own), nothing hangs, a failed load changes no rank's state and a failed save leaves the committed
checkpoint at the path loadable with its old values.

``run_ranks`` kills a hung run after its timeout and raises RankFailure, so a hang fails the test (no timing
assertion needed). The rank functions catch the error they expect and return (type name, message, unchanged?).
"""

from __future__ import annotations

import json

import pytest
import torch
from multiproc import _bad_input_ranks as R

import liferaft
from liferaft import SaveOptions
from liferaft.testing import run_ranks


def _run(fn, path, *args):
    return run_ranks(fn, 2, path, *args, timeout=150.0, pg_timeout=60.0)


def _check(outcome, exc_names, *needles, unchanged=True):
    name, msg, same = outcome
    assert name in exc_names, f"expected one of {exc_names}, got {name}: {msg}"
    for n in needles:
        assert n in msg, f"{n!r} not in message: {msg}"
    if unchanged:
        assert same, f"the state was changed by a failed call ({name}: {msg})"


@pytest.fixture
def committed(tmp_path):
    """A committed checkpoint of R.reference(), saved by one process; returns (path, save_id)."""
    path = str(tmp_path / "ckpt")
    res = liferaft.save(path, R.reference(), options=SaveOptions(block_size=32))   # one hash block per 2 rows
    return path, res.save_id


def _assert_old_intact(path, save_id):
    assert liferaft.inspect(path).save_id == save_id
    state = {"w": torch.zeros(4, 4), "step": 0}
    liferaft.load(path, state)
    ref = R.reference()
    assert torch.equal(state["w"], ref["w"]) and state["step"] == ref["step"]
    liferaft.verify(path)


def test_load_with_wrong_shape_on_rank1(committed):
    path, _ = committed
    r0, r1 = _run(R.load_rank1_wrong_shape, path)
    _check(r1, {"StateMismatchError"}, "'w'")
    _check(r0, {"DistributedError"}, "rank 1", "'w'")


def test_load_of_a_manifest_only_rank0_can_decode(tmp_path):
    # every rank decodes the manifest rank 0 read and checked: a rank that cannot (a codec it lacks) raises, and
    # rank 0, which could, raises too instead of waiting for it in the next collective
    from liferaft.testing import tamper

    path = str(tmp_path / "ckpt")
    liferaft.save(path, {"w": torch.zeros(64, 64), "step": 3}, options=SaveOptions(compression="on"))

    def edit(doc):
        chunks = [c for t in doc["tensors"] for c in t["chunks"] if c.get("codec")]
        assert chunks
        for c in chunks:
            c["codec"] = "x-rank0-only"
    tamper.rewrite_manifest(path, edit)
    r0, r1 = _run(R.load_codec_known_to_rank0_only, path)
    _check(r1, {"CorruptCheckpointError"}, "x-rank0-only")
    _check(r0, {"DistributedError"}, "rank 1", "x-rank0-only")


@pytest.mark.parametrize("atomic", [False, True])
def test_load_with_corrupt_bytes_only_rank1_reads(committed, atomic):
    path, _ = committed
    manifest = json.loads(open(f"{path}/{json.load(open(f'{path}/COMMIT'))['manifest']}").read())
    (chunk,) = next(t for t in manifest["tensors"] if t["key"] == "w")["chunks"]
    assert chunk["block_size"] == 32, "the test needs rows 0-1 and rows 2-3 in separate hash blocks"
    with open(f"{path}/{chunk['file']}", "r+b") as f:     # a byte of row 3: only rank 1's half
        f.seek(chunk["byte_offset"] + 50)
        b = f.read(1)
        f.seek(chunk["byte_offset"] + 50)
        f.write(bytes([b[0] ^ 0x10]))
    r0, r1 = _run(R.load_sharded_rank1_corrupt, path, atomic)
    _check(r1, {"CorruptCheckpointError"}, "'w'", chunk["file"])
    # rank 0's bytes are fine: without LoadOptions(atomic=True) it may already hold them when rank 1 fails
    _check(r0, {"DistributedError"}, "rank 1", "CorruptCheckpointError", unchanged=atomic)


def test_save_with_custom_object_on_rank1(committed):
    path, save_id = committed
    r0, r1 = _run(R.save_rank1_custom_object, path)
    _check(r1, {"PickleNotAllowedError"}, "'obj'")
    _check(r0, {"DistributedError"}, "rank 1", "'obj'")
    _assert_old_intact(path, save_id)


def test_save_with_overlapping_shards(committed):
    path, save_id = committed
    for outcome in _run(R.save_overlapping_shards, path):
        _check(outcome, {"InvalidStateError"}, "'w'", "overlap")
    _assert_old_intact(path, save_id)


def test_save_with_different_global_shapes(committed):
    path, save_id = committed
    for outcome in _run(R.save_different_global_shapes, path):
        _check(outcome, {"InvalidStateError"}, "'w'", "rank 1", "[5, 4]")
    _assert_old_intact(path, save_id)


def test_save_where_rank1_cannot_write_its_data(committed):
    """A crash in the middle of an overwrite: rank 0 has written its data file, rank 1 fails."""
    path, save_id = committed
    r0, r1 = _run(R.save_rank1_write_fails, path)
    _check(r1, {"OSError", "StorageError"}, "no space left")
    _check(r0, {"DistributedError"}, "rank 1", "no space left")
    _assert_old_intact(path, save_id)
