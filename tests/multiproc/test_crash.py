"""kill -9 of one rank, or of all ranks, at each phase of a save, during retention and during a restore: a fresh
job then restores the newest committed step, bit for bit, and leftovers are cleaned up.

Job 1 saves steps 0-3 normally (keep_last=2), then crashes at step 4 as the case says; job 2 restores (on 2 or 3
ranks) and must find step 3 (crash before the commit point) or 4 (after it), exact. Every step references
step 0's chunks of a frozen tensor, so step 0 is kept (reference-aware retention) and a crash while retention
deletes another step must leave every committed step loadable.
"""

from __future__ import annotations

import os

import pytest
from multiproc._crash_ranks import job, restore_crashing

import liferaft
from liferaft.testing import RankFailure, run_ranks

DATA = "data/"
CASES = {
    # name: (plan, crash ranks, kill right after maybe_save returns, steps restorable after the crash)
    "after-snapshot/one": (None, [1], True, {3, 4}),
    "after-snapshot/all": (None, [0, 1], True, {3, 4}),
    "mid-write/one": ({"op": "pwrite", "match": DATA, "nth": 1, "when": "after"}, [1], False, {3}),
    "mid-write/all": ({"op": "pwrite", "match": DATA, "nth": 1, "when": "after"}, [0, 1], False, {3}),
    "after-data-before-manifest": ({"op": "put", "match": "manifest-"}, [0], False, {3}),
    "between-manifest-and-marker": ({"op": "put", "match": "COMMIT"}, [0], False, {3}),
    "right-after-marker": ({"op": "put", "match": "COMMIT", "when": "after"}, [0], False, {4}),
    "during-retention": ({"op": "delete", "match": "step-0000000002/data/", "when": "after"}, [0], False, {4, 5}),
}


def _steps(root):
    """Steps that hold any file (an empty folder left by a rank killed before its first write is no step)."""
    return sorted(int(d.split("-")[1]) for d in os.listdir(root)
                  if d.startswith("step-") and any(files for _, _, files in os.walk(os.path.join(root, d))))


@pytest.mark.parametrize("case", list(CASES))
def test_kill_9_then_resume(tmp_path, case):
    plan, ranks, kill_after_call, expected = CASES[case]
    root = str(tmp_path / "run")
    run_ranks(job, 2, root, 3, -1, None, [], timeout=120)                 # steps 0..3, committed
    assert _steps(root) == [0, 2, 3]                                      # 0: referenced by 2 and 3
    with pytest.raises(RankFailure):
        run_ranks(job, 2, root, 5, 4, plan, ranks, kill_after_call, timeout=120)
    # a fresh job on another number of ranks resumes from the newest committed step, exactly
    out = run_ranks(job, 3, root, -1, -1, None, [], timeout=120)
    starts = {s for s, _ in out}
    assert len(starts) == 1 and starts <= expected, out
    assert all(exact for _, exact in out), out
    # leftovers of the crash (an uncommitted step, a half-deleted one) are gone after the restart
    assert _steps(root)[-1] == starts.pop() and len(_steps(root)) <= 4 and _steps(root)[0] == 0
    for step in _steps(root):           # every committed step verifies, the chunks it references included
        path = os.path.join(root, f"step-{step:010d}")
        if os.path.exists(os.path.join(path, "COMMIT")):
            liferaft.verify(path)


def test_kill_9_during_restore_then_resume(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(job, 2, root, 4, -1, None, [], timeout=120)
    with pytest.raises(RankFailure):
        run_ranks(restore_crashing, 2, root, {"op": "read", "match": DATA, "nth": 2}, [1], timeout=120)
    out = run_ranks(job, 2, root, -1, -1, None, [], timeout=120)
    assert out == [(4, True), (4, True)]
