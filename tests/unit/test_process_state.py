"""What a process keeps between saves: the plan cache is bounded, ``liferaft.release()`` frees the pools and the
plans after waiting for a save in flight, and surfaces a failed save nobody waited for."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.core.caches import PLANS, PlanCache
from liferaft.core.process import PROCESS
from liferaft.storage import register_scheme
from liferaft.testing.faults import FailingStorage

register_scheme("failrelease", FailingStorage)


def test_the_plan_cache_keeps_the_most_recently_used_plans_up_to_its_limit():
    cache = PlanCache(limit=3)
    for i in range(5):
        cache.put((f"g{i}", 0, 1, 64, 1), ((), None, f"s{i}"))  # type: ignore[arg-type]
    assert [k[0] for k, _ in cache.items()] == ["g2", "g3", "g4"]
    assert cache.get(("g2", 0, 1, 64, 1)) is not None           # used: now the newest
    cache.put(("g5", 0, 1, 64, 1), ((), None, "s5"))  # type: ignore[arg-type]
    assert [k[0] for k, _ in cache.items()] == ["g4", "g2", "g5"]
    assert cache.get(("g0", 0, 1, 64, 1)) is None
    cache.clear()
    assert len(cache) == 0


def test_release_waits_for_the_save_in_flight_then_frees_pools_and_plans(tmp_path):
    state = {"w": torch.randn(256, 256)}
    h = liferaft.async_save(str(tmp_path / "a"), state)
    liferaft.save(str(tmp_path / "b"), state)
    assert PROCESS.pool is not None and len(PLANS) >= 1
    liferaft.release()
    assert h.done() and PROCESS.inflight is None
    assert PROCESS.pool is None and PROCESS.ring is None and len(PLANS) == 0
    liferaft.save(str(tmp_path / "c"), state)                       # everything is made again on use
    assert torch.equal(liferaft.read(str(tmp_path / "c"))["w"], state["w"])
    assert h.wait().save_id and torch.equal(liferaft.read(str(tmp_path / "a"))["w"], state["w"])


def test_release_surfaces_a_failed_async_save_nobody_waited_for(tmp_path):
    FailingStorage.active = True
    h = liferaft.async_save(f"failrelease://{tmp_path}/x", {"w": torch.ones(1000)})
    assert h is not None
    with pytest.raises(liferaft.LiferaftError, match="nobody waited for it"):
        liferaft.release()
    assert PROCESS.pool is None and PROCESS.inflight is None        # freed all the same
    liferaft.release()                                              # reported once
