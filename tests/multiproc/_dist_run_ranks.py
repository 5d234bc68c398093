"""Rank functions for ``Coordinator.run`` / ``run_on_zero`` and the plan cache (imported as
``multiproc._dist_run_ranks``)."""

from __future__ import annotations

from typing import Any

import torch

import liferaft
from liferaft.dist import Coordinator


def _outcome(call: Any) -> tuple[str, str]:
    """(type name, message) of what ``call()`` raised, or ("ok", repr of its result)."""
    try:
        return "ok", repr(call())
    except BaseException as e:  # noqa: BLE001 - the test looks at what each rank raised
        return type(e).__name__, str(e)


def run_and_run_on_zero(rank: int, world: int) -> dict[str, Any]:
    """What ``run`` and ``run_on_zero`` give on each rank, when every rank succeeds and when one fails."""
    coord = Coordinator(timeout=60)
    out: dict[str, Any] = {"gathered": coord.run(lambda: rank * 10, "test (ok)")}

    def fail_on_one() -> int:
        if rank == 1:
            raise ValueError(f"boom on rank {rank}")
        return rank

    cleaned: list[int] = []
    out["failure"] = _outcome(lambda: coord.run(fail_on_one, "test (one fails)", cleanup=lambda: cleaned.append(rank)))
    out["cleaned"] = cleaned
    out["after"] = coord.run(lambda: rank, "test (after a failure)")        # the group still serves

    calls: list[int] = []

    def on_zero() -> str:
        calls.append(rank)
        return f"read by rank {rank}"

    out["zero"] = coord.run_on_zero(on_zero, "test (rank 0 reads)")
    out["zero_calls"] = calls

    def zero_fails() -> str:
        raise FileNotFoundError(f"nothing there for rank {rank}")

    out["zero_failure"] = _outcome(lambda: coord.run_on_zero(zero_fails, "test (rank 0 fails)"))
    return out


def plans_after_regroup(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two saves of one layout (the plan is reused), then the groups are released (the next save goes over a
    new group, with a new key: planned anew), then ``liferaft.release()`` drops plans, pools and groups."""
    from liferaft.core.caches import PLANS
    from liferaft.core.process import PROCESS

    state = {"w": liferaft.Sharded(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0)), "step": 1}
    opts = liferaft.SaveOptions(timeout=60)

    def plan_id() -> tuple[str, str]:
        key, (_, _, planned_for) = PLANS.items()[-1]       # the most recently used entry
        return key[0], planned_for

    out: dict[str, Any] = {}
    saved = liferaft.save(f"{root}/a", state, options=opts)
    out["first"] = (plan_id(), saved.save_id)
    liferaft.save(f"{root}/b", state, options=opts)
    out["second"] = plan_id()
    liferaft.release_groups()
    saved = liferaft.save(f"{root}/c", state, options=opts)
    out["third"] = (plan_id(), saved.save_id)
    out["entries"] = len(PLANS)
    h = liferaft.async_save(f"{root}/d", state, options=opts)
    assert h is not None
    liferaft.release()                          # waits for the save in flight first
    out["released"] = (h.done(), len(PLANS), PROCESS.pool is None and PROCESS.ring is None, PROCESS.inflight)
    back = {"w": liferaft.Sharded(torch.zeros(2, 3), (2 * world, 3), (2 * rank, 0)), "step": 0}
    liferaft.load(f"{root}/d", back, options=liferaft.LoadOptions(timeout=60))   # new groups, made on use
    out["loaded"] = torch.equal(back["w"].local, state["w"].local) and back["step"] == 1
    return out


def tier_listing_fails_on_one_rank(rank: int, world: int, base: str) -> tuple[str, str]:
    """A memory tier whose rank 1 cannot list its node's copy (its listing raises, as an I/O error would; a
    dangling link or a FIFO among the data files no longer does: such an entry is simply not held): what
    ``restore`` raises on each rank."""
    from liferaft.tiers.memory import MemoryTier

    class ListingFails(MemoryTier):
        def _listing(self, step: int, accept=None):  # type: ignore[no-untyped-def]
            raise FileNotFoundError(f"{self.root}: the node's copy of step {step} vanished while listing")

    tier = (ListingFails if rank == 1 else MemoryTier)("listing-test", node=f"n{rank}", base=base, replicas=0,
                                                       timeout=30)
    tier.save(1, {"w": torch.full((4,), float(rank))}, wait=True)
    return _outcome(lambda: tier.restore({"w": torch.zeros(4)}))
