"""A Monte-Carlo simulation of a training job's month, failure by failure (pure; ``liferaft plan --simulate``).

The same job as ``manager.goodput``'s closed form, with nothing averaged: failures arrive as a Poisson process at the
cluster's rate, each of a class drawn from its shares; between failures every tier of the plan saves every ``τ``
seconds of wall time from the (re)start (each save stalls training ``stall`` seconds, then persists in the
background for the rest of ``persist`` at ``interference`` of the step time, and is durable at its end; a remote
save that starts while the store is down is lost). A failure rolls progress back to the newest durable save that
survives its class (``goodput.SURVIVORS``; a multi-node failure loses the memory tier's copies, and the memory
tier holds nothing until its next save), then pays the restart's parts, the restore from that place, and, for a
copy in the store while the store is down, the wait until it is back. A failure during a recovery starts another
one (the time spent is counted as ``interrupted``), which the closed form ignores.

Every second of the horizon lands in exactly one bucket (``Simulation.seconds``): ``useful`` (training that is
never lost), ``lost work`` (training rolled back), ``save stalls``, ``save interference``, each restart part,
``restore``, ``storage wait``, ``interrupted``. Goodput = useful / horizon; several independent months give a
mean and a 95 % interval.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from liferaft.manager.goodput import Cluster, Costs, survivors

MONTH_S = 30 * 86400.0


@dataclass(frozen=True)
class Simulation:
    """``goodput``: mean over the simulated horizons; ``ci95``: the half-width of its 95 % interval; ``seconds``:
    bucket → mean seconds per horizon; ``failures``: class → mean count per horizon; ``horizons``: how many."""

    goodput: float
    ci95: float
    seconds: Mapping[str, float]
    failures: Mapping[str, float]
    horizons: int


class _Tier:
    """One tier's save schedule within a segment of training that starts at wall time ``start`` with progress
    ``base``: saves start at ``k·tau`` (k ≥ 1) after it."""

    def __init__(self, name: str, tau: float, stall: float, persist: float, interference: float) -> None:
        self.name = name
        self.persist = max(persist, stall)
        # a save is durable before the next starts, but for the per-step log, whose records are durable
        # ``lost_steps`` steps late (no interference: its overhead is measured whole, as its stall)
        self.tau = max(tau, 1e-9) if name == "step" else max(tau, self.persist, 1e-9)
        self.stall = stall
        self.interference = interference

    def lost(self, x: float) -> tuple[float, float]:
        """(stall seconds, interference seconds) in the first ``x`` seconds of a segment."""
        y = x - self.tau
        if y < 0:
            return 0.0, 0.0
        n = math.floor(y / self.tau)
        u = y - n * self.tau
        background = min(self.persist, self.tau) - self.stall
        return (n * self.stall + min(u, self.stall),
                self.interference * (n * background + min(max(u - self.stall, 0.0), background)))

    def newest(self, x: float, first: int = 1) -> int:
        """The index k of the newest save durable ``x`` seconds into the segment (0: none), k ≥ ``first``."""
        if x < self.tau + self.persist:
            return 0
        k = math.floor((x - self.persist) / self.tau)
        return k if k >= first else 0


def simulate(costs: Costs, cluster: Cluster, intervals: Mapping[str, float], *, horizon_s: float = MONTH_S,
             horizons: int = 8, seed: int = 0) -> Simulation:
    """Simulate ``horizons`` independent runs of ``horizon_s`` seconds of the plan that saves tier t every
    ``intervals[t]`` seconds ("memory", "remote", "step"); ``seed`` makes it reproducible."""
    if horizons < 1 or not horizon_s > 0:
        raise ValueError("horizons must be at least 1 and horizon_s positive")
    rng = random.Random(seed)
    runs = [_one(costs, cluster, intervals, horizon_s, rng) for _ in range(horizons)]
    goodputs = [r[0]["useful"] / horizon_s for r in runs]
    keys = sorted({k for r in runs for k in r[0]})
    ci = 1.96 * statistics.stdev(goodputs) / math.sqrt(horizons) if horizons > 1 else float("nan")
    return Simulation(goodput=statistics.fmean(goodputs), ci95=ci,
                      seconds={k: statistics.fmean(r[0].get(k, 0.0) for r in runs) for k in keys},
                      failures={c: statistics.fmean(r[1].get(c, 0) for r in runs) for c in cluster.shares},
                      horizons=horizons)


def _one(costs: Costs, cluster: Cluster, intervals: Mapping[str, float], horizon: float,
         rng: random.Random) -> tuple[dict[str, float], dict[str, int]]:
    lam = cluster.rate_per_s
    classes = [c for c, s in cluster.shares.items() if s > 0]
    weights = [cluster.shares[c] for c in classes]
    tiers = []
    for name, tau in intervals.items():
        stall, persist = costs.tier(name)
        tiers.append(_Tier(name, tau, stall, persist, 0.0 if name == "step" else costs.interference))
    buckets: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(k: str, v: float) -> None:
        buckets[k] = buckets.get(k, 0.0) + v

    # the newest durable save of each tier: progress at its start; the job starts from a saved state (progress 0)
    durable: dict[str, float | None] = {t.name: 0.0 for t in tiers}
    store_back = 0.0                          # the store is down until then
    t, base = 0.0, 0.0                        # the segment's start (wall) and its progress
    fail = rng.expovariate(lam) if lam > 0 else math.inf
    while True:
        end = min(fail, horizon)
        x = end - t
        stalls = [tier.lost(x) for tier in tiers]
        add("save stalls", sum(s for s, _ in stalls))
        add("save interference", sum(i for _, i in stalls))
        progress = base + x - sum(s + i for s, i in stalls)
        if fail >= horizon:
            add("useful", progress)
            break
        for tier in tiers:                    # the saves of this segment that became durable
            first = 1
            if tier.name == "remote" and store_back > t:        # saves started while the store was down are lost
                first = math.ceil((store_back - t) / tier.tau)
            k = tier.newest(x, first)
            if k:
                at = k * tier.tau
                durable[tier.name] = base + at - sum(sum(o.lost(at)) for o in tiers)
        # the failure, and the recoveries it takes (a failure during a recovery starts another)
        now, done = fail, progress
        while True:
            cls = rng.choices(classes, weights)[0]
            counts[cls] = counts.get(cls, 0) + 1
            if cls == "storage":
                store_back = max(store_back, now + cluster.storage_outage_s)
            _, place, q = _survivor(costs, survivors(cls, cluster.nodes), durable, now, store_back)
            if survivors(cls, cluster.nodes).get("memory") is None:     # the class lost every node's copy
                for name in ("memory", "step"):
                    if name in durable:
                        durable[name] = None
            add("lost work", done - q)
            done = q
            parts = dict(costs.restart_of(cls))
            parts["restore"] = costs.restore_from(place)
            if place == "remote" and store_back > now:
                parts["storage wait"] = store_back - now
            need = sum(parts.values())
            fail = now + (rng.expovariate(lam) if lam > 0 else math.inf)
            if fail >= now + need or fail >= horizon:
                stop = min(now + need, horizon)
                left = stop - now
                for name, s in parts.items():                    # in order, cut at the horizon
                    add(name, min(s, left))
                    left -= min(s, left)
                now = stop
                break
            add("interrupted", fail - now)
            now = fail
        if now >= horizon:
            add("useful", done)
            break
        t, base = now, done
    return buckets, counts


def _survivor(costs: Costs, places: Mapping[str, str], durable: Mapping[str, float | None], now: float,
              store_back: float) -> tuple[str, str, float]:
    """(tier, place, progress) of the newest save surviving a failure whose surviving tiers are ``places``
    (``goodput.survivors``); ties go to the cheaper restore (with the store's wait)."""
    best: tuple[float, float, str, str] | None = None
    for tier, progress in durable.items():
        place = places.get(tier)
        if place is None or progress is None:
            continue
        cost = costs.restore_from(place) + (max(0.0, store_back - now) if place == "remote" else 0.0)
        if best is None or (progress, -cost) > (best[0], -best[1]):
            best = (progress, cost, tier, place)
    if best is None:                          # nothing survives: start over (the job's initial state)
        return "remote", "remote", 0.0
    return best[2], best[3], best[0]
