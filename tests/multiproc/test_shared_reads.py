"""Shared reads: a span several ranks need is read from storage once and sent to the others; received bytes are
verified; a corrupt shared span fails every rank without a hang."""

from __future__ import annotations

import pytest
from multiproc import _share_ranks as R

import liferaft
from liferaft.planning.share_plan import plan_sharing
from liferaft.testing import run_ranks
from liferaft.testing.tamper import read_manifest


def _run(fn, world, *args):
    return run_ranks(fn, world, *args, timeout=150.0, pg_timeout=60.0)


def _nbytes(names):
    ref = R.reference()
    return sum(ref[k].numel() * 4 for k in names)


def _flip_bit(path, key, at):
    """Flip the low bit of byte ``at`` of ``key``'s (single) chunk in the checkpoint at ``path``."""
    manifest, _ = read_manifest(path)
    (chunk,) = next(t for t in manifest["tensors"] if t["key"] == key)["chunks"]
    with open(f"{path}/{chunk['file']}", "r+b") as f:
        f.seek(chunk["byte_offset"] + at)
        b = f.read(1)
        f.seek(chunk["byte_offset"] + at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, R.reference())
    return path


def test_replicated_load_reads_each_span_once(saved):
    out = _run(R.load_replicated, 3, saved, True)
    assert all(o[0] == "ok" and o[1] for o in out), out
    from_storage = sum(o[2] - o[3] for o in out)
    # ranks of one host share through its memory: every span read once in all, the small one too (it rides in
    # its reader's run; over the process group a span below MIN_SHARED_BYTES is read by each rank)
    assert from_storage == _nbytes(R.BIG) + _nbytes(R.SMALL), out
    assert sum(1 for o in out if o[3] > 0) >= 2, f"the reads were not spread: {out}"
    off = _run(R.load_replicated, 3, saved, False)
    assert all(o[0] == "ok" and o[1] and o[3] == 0 for o in off), off
    assert sum(o[2] for o in off) == 3 * _nbytes({**R.BIG, **R.SMALL})


def test_reshard_rows_to_columns_shares_the_blocks(tmp_path):
    path = str(tmp_path / "ck")
    _run(R.save_rows, 2, path)
    out = _run(R.load_columns, 2, path)
    assert all(o[0] for o in out), out
    assert all(o[2] > 0 for o in out), f"each rank should receive half of the rows: {out}"
    assert sum(o[1] - o[2] for o in out) == _nbytes(("a", "b")), out
    # a segment's slots are sized to what its rank reads (4 MiB in all here), not to the read size (8 MiB)
    assert all(len(o[3]) <= 1 and all(size <= _nbytes(("a", "b")) + (64 << 10) for size in o[3]) for o in out), out
    assert sum(len(o[3]) for o in out) >= 1, out


def test_a_load_with_nothing_to_share_makes_no_segment(tmp_path):
    path = str(tmp_path / "ck")
    _run(R.save_rows, 2, path)
    out = _run(R.load_columns, 2, path, 0)
    assert all(o[0] and o[2] == 0 and o[3] == [] for o in out), out


@pytest.mark.parametrize("atomic", [False, True])
def test_corrupt_shared_span_fails_every_rank(saved, atomic):
    _flip_bit(saved, "b", 1000)
    out = _run(R.load_replicated, 3, saved, True, atomic)
    for o in out:
        assert o[0] in ("CorruptCheckpointError", "DistributedError"), out
        assert "'b'" in o[1], out
        if atomic:
            assert o[2], f"an atomic load changed the state: {out}"
    assert any(o[0] == "CorruptCheckpointError" for o in out)


def test_a_run_of_many_small_spans_is_read_once_and_told_in_several_notices(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, R.many_reference())
    out = _run(R.load_many, 3, path)
    assert all(o[0] == "ok" and o[1] is True for o in out), out
    total = sum(v.numel() * 4 for v in R.many_reference().values())
    assert sum(o[2] - o[3] for o in out) == total, f"each span should be read once on the host: {out}"
    assert all(o[3] > 0 for o in out[1:]) or all(o[3] > 0 for o in out[:2]), f"nothing was shared: {out}"


def test_a_corrupt_span_in_the_middle_of_a_run_fails_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, R.many_reference())
    _flip_bit(path, "m100", 100)
    out = _run(R.load_many, 3, path)
    assert all(o[0] in ("CorruptCheckpointError", "DistributedError") and "'m100'" in o[1] for o in out), out
    assert any(o[0] == "CorruptCheckpointError" for o in out), out


def test_small_spans_are_shared_only_when_linked_to_a_long_one():
    mib = 1 << 20
    # a resharded layer: long chunks with small weights and biases between them, all needed by both ranks
    layer = [("f", 0, 2 * mib), ("f", 2 * mib, 4096), ("f", 2 * mib + 4096, 512 << 10),
             ("f", 2 * mib + (516 << 10), 4096), ("f", 3 * mib, 2 * mib)]
    assert set(plan_sharing([layer] * 2, run_bytes=32 * mib)) == set(layer)
    assert set(plan_sharing([layer] * 2)) == {layer[0], layer[4]}          # without runs: the long ones only
    # 0-dim steps (replicated) between row shards only one rank needs: each rank reads its own steps
    rows0, rows1 = ("f", 0, 8 * mib), ("f", 8 * mib + 8192, 8 * mib)
    steps = [("f", 8 * mib, 4096), ("f", 16 * mib + 8192, 4096)]
    assert plan_sharing([[rows0] + steps, [rows1] + steps], run_bytes=32 * mib) == {}
    # a checkpoint saved in small chunks: a chain of short spans, long in all, is shared
    small = [("f", i * (256 << 10), 256 << 10) for i in range(8)]
    assert set(plan_sharing([small] * 2, run_bytes=32 * mib)) == set(small)
    assert plan_sharing([small[:3]] * 2, run_bytes=32 * mib) == {}         # 768 KiB in all: read by each rank
    # a chain breaks at a gap longer than RUN_GAP, and at a span needed by other ranks
    far = [("f", 0, 2 * mib), ("f", 3 * mib, 4096)]
    assert set(plan_sharing([far] * 2, run_bytes=32 * mib)) == {far[0]}
    other = [("f", 0, 2 * mib), ("f", 2 * mib, 4096)]
    assert set(plan_sharing([other, other, other[:1]], run_bytes=32 * mib)) == {other[0]}


def test_plan_sharing_gives_a_reader_runs_of_adjacent_spans():
    spans = [("f", i * (4 << 20), 4 << 20) for i in range(6)]
    plan = plan_sharing([spans] * 3, min_bytes=0, run_bytes=8 << 20)
    assert [plan[s].reader for s in spans] == [0, 0, 1, 1, 2, 2]      # runs of 8 MiB, each to the least loaded
    assert [plan[s].tag for s in spans] == list(range(6))
    gap = [("f", 0, 1 << 20), ("f", (1 << 20) + (1 << 19), 1 << 20)]    # 512 KiB apart: more than RUN_GAP
    assert [plan_sharing([gap] * 2, min_bytes=0, run_bytes=8 << 20)[s].reader for s in gap] == [0, 1]
    other = [("f", 0, 1 << 20), ("f", 1 << 20, 1 << 20)]                # the second needed by ranks 0 and 2 only
    plan = plan_sharing([other, other[:1], other], min_bytes=0, run_bytes=8 << 20)
    assert (plan[other[0]].reader, plan[other[1]].reader) == (0, 2)    # another run: the least loaded of 0, 2
    files = [("f", 0, 1 << 20), ("g", 0, 1 << 20)]                       # a run never spans two files
    assert [plan_sharing([files] * 2, min_bytes=0, run_bytes=8 << 20)[s].reader for s in files] == [0, 1]
    assert plan_sharing([spans] * 3, min_bytes=0) == plan_sharing([spans] * 3, min_bytes=0, run_bytes=0)


def test_plan_sharing_is_balanced_ordered_and_skips_small_or_unique_spans():
    big = [("f", i * (4 << 20), 4 << 20) for i in range(6)]
    small = ("f", 1 << 30, 4096)
    only0 = ("g", 0, 8 << 20)
    plan = plan_sharing([big + [small, only0], big + [small], big], min_bytes=1 << 20)
    assert set(plan) == set(big)                      # the small and the single-rank spans are read locally
    assert [plan[s].tag for s in sorted(plan)] == list(range(6))
    assert [plan[s].reader for s in sorted(plan)] == [0, 1, 2, 0, 1, 2]     # in turn: all ranks read at once
    for s in big:
        p = plan[s]
        assert p.reader not in p.receivers and len(p.receivers) == 2 and (p.start, p.length) == s[1:]
    assert plan_sharing([big, [("f", 0, 4 << 20)]])[("f", 0, 4 << 20)].receivers in ((0,), (1,))
    # every rank computes the same plan from the same inputs, whatever order it lists its spans in
    assert plan_sharing([big, big[::-1]]) == plan_sharing([big[::-1], big])
