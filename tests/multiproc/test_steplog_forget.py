"""The per-step log's removal of the records past a resume step is collective: a rank that returns from
``restore`` first and records its next step never has that record removed by its node's removal (a slowed one
here)."""

from __future__ import annotations

import pytest
from multiproc._steplog_forget_ranks import forget_job

from liferaft.testing import RankFailure, run_ranks


def test_records_after_a_resume_survive_a_slow_removal(tmp_path):
    root, base = str(tmp_path / "root"), str(tmp_path / "shm")
    with pytest.raises(RankFailure):
        run_ranks(forget_job, 2, root, base, 6, False, True, timeout=120)     # full 4, records 5, 6
    with pytest.raises(RankFailure):
        run_ranks(forget_job, 2, root, base, 7, True, True, timeout=120)      # resumes at 6, records 7
    out = run_ranks(forget_job, 2, root, base, 7, False, False, timeout=120)
    assert [o["start"] for o in out] == [7, 7], [o["recovery"] for o in out]
    assert all(o["recovery"]["why"] == "" for o in out)
