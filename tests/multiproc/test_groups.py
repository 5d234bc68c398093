"""liferaft's own gloo groups: made once and reused, released and remade any number of times without a race,
every collective bounded by the options' timeout."""

from __future__ import annotations

import pytest
from multiproc._groups_ranks import save_release_cycles, timeout_is_honoured

from liferaft.testing import run_ranks


@pytest.mark.parametrize("world", [2, 3])
def test_fifty_cycles_of_save_release_and_manager_close(tmp_path, world):
    # 50 × (save; release_groups), with a manager made and closed every third cycle followed by a plain save:
    # with groups re-made by new_group(use_local_synchronization=True) this hung in connectFullMesh within ~20
    # cycles (stale store keys of the destroyed group under the same hashed name)
    assert run_ranks(save_release_cycles, world, str(tmp_path), 50, timeout=240) == [50] * world


def test_a_collective_is_bounded_by_the_options_timeout_and_the_group_recovers(tmp_path):
    out = run_ranks(timeout_is_honoured, 2, str(tmp_path), timeout=120)
    assert out[1] == "arrived"
    assert out[0].startswith("DistributedError after"), out[0]
    seconds = float(out[0].split()[2].rstrip("s:"))
    assert seconds < 5.0, out[0]                    # the options' 2 s, not gloo's 30 min default
    assert "save (planning) failed on rank 0 of 2" in out[0], out[0]         # the phase, named
