"""When to save, and what it buys: the Young/Daly interval and a goodput model of tiered checkpointing (pure).

Young (1974) / Daly (2006): with a checkpoint costing ``C`` seconds of lost training time and a mean time between
failures ``M``, the interval that maximizes useful work is ``τ = sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) − C``
(``τ = M`` when ``C ≥ 2M``); a tier's interval is never shorter than its persist time.

Goodput (the share of wall time that is useful training) of a job with one save schedule per tier: every save of
tier t costs its stall ``s_t`` every ``τ_t`` seconds; a failure of class c (the process or the whole job, one node,
several nodes at once) happens at rate ``λ_c`` and costs the restart overhead, the restore from the nearest tier
that survives it and, on average, half the interval of that tier in recomputed work:
``goodput = 1 − Σ_t s_t/τ_t − Σ_c λ_c (restart + restore_c + τ_{tier(c)}/2)``, floored at 0.

With measured per-step costs (``Costs.per_step``: the per-step log's step-time overhead, the step time, the time
from a restart to the first step and the steps a failure loses), a fourth plan: every step recoverable for the
failures memory and its peer replicas cover, ``1 − overhead − Σ_{job,node} λ_c (restart + restore + lost × step)``,
and remote saves at their interval for the multi-node failures, as in the tiers plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that maximizes useful work for a save costing ``cost_s`` seconds of
    training time and failures every ``mtbf_s`` seconds on average (Daly's higher-order form of Young's)."""
    if cost_s <= 0:
        return 0.0
    if mtbf_s <= 0 or cost_s >= 2 * mtbf_s:
        return max(mtbf_s, cost_s)
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


@dataclass(frozen=True)
class Costs:
    """Measured costs in seconds: the training stall of one save per tier, the restore from each place, the fixed
    restart overhead (rescheduling, process start, collectives) paid by every failure."""

    stall: Mapping[str, float]                       # tier → seconds of training lost per save ("memory", "remote")
    restore: Mapping[str, float]                     # "memory", "peer", "remote" → seconds
    restart: float = 120.0
    persist: Mapping[str, float] = field(default_factory=dict)   # tier → seconds until a save is durable there
    #: the per-step log, measured: "overhead" (share of step time), "step" (s), "restore" (s), "lost_steps"
    per_step: Mapping[str, float] | None = None

    def interval(self, tier: str, mtbf_s: float) -> float:
        """Young/Daly for the tier's stall, but never shorter than its persist time (a save cannot start before
        the previous one is durable)."""
        return max(young_daly(self.stall[tier], mtbf_s), self.persist.get(tier, 0.0))


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` per node; ``failures_per_gpu_hour`` in all; ``node_share`` of failures take
    a node (its memory) down, ``multi_node_share`` take several nodes whose replicas may then be gone, the rest
    are process or job failures that leave every node's memory intact."""

    gpus: int
    failures_per_gpu_hour: float = 2e-5              # ~ Llama 3: 419 interruptions in 54 days on 16k GPUs
    node_share: float = 0.5
    multi_node_share: float = 0.02
    gpus_per_node: int = 8

    @property
    def rate_per_s(self) -> float:
        return self.gpus * self.failures_per_gpu_hour / 3600.0


@dataclass(frozen=True)
class Plan:
    name: str
    intervals: Mapping[str, float]                   # tier → seconds between saves
    goodput: float
    breakdown: Mapping[str, float] = field(default_factory=dict)


def goodput(costs: Costs, cluster: Cluster, intervals: Mapping[str, float], recovery: Mapping[str, str]) -> Plan:
    """Goodput of saving tier t every ``intervals[t]`` seconds; ``recovery`` maps each failure class ("job",
    "node", "multi") to the place it restores from ("memory", "peer", "remote"), whose tier's interval sets the
    lost work ("memory"/"peer" → tier "memory")."""
    lam = cluster.rate_per_s
    shares = {"job": 1 - cluster.node_share - cluster.multi_node_share, "node": cluster.node_share,
              "multi": cluster.multi_node_share}
    save_cost = sum(costs.stall[t] / tau for t, tau in intervals.items() if tau > 0)
    fail_cost = 0.0
    for cls, share in shares.items():
        where = recovery[cls]
        tier = "memory" if where in ("memory", "peer") else "remote"
        fail_cost += lam * share * (costs.restart + costs.restore[where] + intervals[tier] / 2)
    return Plan(name="", intervals=dict(intervals), goodput=max(0.0, 1 - save_cost - fail_cost),
                breakdown={"saving": save_cost, "failures": fail_cost})


def compare(costs: Costs, cluster: Cluster, fixed_remote_s: float = 3600.0) -> list[Plan]:
    """Three ways to run the same job: remote saves at a fixed interval (no tiers, ``fixed_remote_s``), remote
    only at its Young/Daly interval, and liferaft's memory tier (+ peer replicas) at its Young/Daly interval for
    the failures it covers plus remote at the interval for the failures only remote covers."""
    lam = cluster.rate_per_s
    remote_only = {"job": "remote", "node": "remote", "multi": "remote"}
    out = []
    p = goodput(costs, cluster, {"remote": fixed_remote_s}, remote_only)
    out.append(Plan("no tiers: remote every %.0f min" % (fixed_remote_s / 60), p.intervals, p.goodput, p.breakdown))
    tau = costs.interval("remote", 1 / lam)
    p = goodput(costs, cluster, {"remote": tau}, remote_only)
    out.append(Plan("remote only, Young/Daly interval", p.intervals, p.goodput, p.breakdown))
    covered = lam * (1 - cluster.multi_node_share)
    tau_mem = costs.interval("memory", 1 / covered)
    tau_remote = costs.interval("remote", 1 / (lam * cluster.multi_node_share)) \
        if cluster.multi_node_share > 0 else 24 * 3600.0
    p = goodput(costs, cluster, {"memory": tau_mem, "remote": tau_remote},
                {"job": "memory", "node": "peer", "multi": "remote"})
    out.append(Plan("liferaft tiers: memory + peer replicas, remote; auto intervals", p.intervals, p.goodput,
                    p.breakdown))
    if costs.per_step is not None:
        out.append(per_step_plan(costs, cluster, tau_remote))
    return out


def per_step_plan(costs: Costs, cluster: Cluster, tau_remote: float) -> Plan:
    """The per-step log as measured (``costs.per_step``): job and node failures resume from the last step (lose
    ``lost_steps`` steps, pay ``restore``), multi-node failures from remote saves every ``tau_remote`` seconds."""
    ps = costs.per_step or {}
    lam = cluster.rate_per_s
    covered = lam * (1 - cluster.multi_node_share)
    saving = ps["overhead"] + (costs.stall["remote"] / tau_remote if tau_remote > 0 else 0.0)
    failures = covered * (costs.restart + ps["restore"] + ps["lost_steps"] * ps["step"]) \
        + lam * cluster.multi_node_share * (costs.restart + costs.restore["remote"] + tau_remote / 2)
    return Plan("liferaft per-step log (measured): every step recoverable, remote", {"step": ps["step"],
                "remote": tau_remote}, max(0.0, 1 - saving - failures), {"saving": saving, "failures": failures})


def table(costs: Costs, gpu_counts: Sequence[int], **cluster: float) -> str:
    """Markdown: the three plans' goodput and intervals at each GPU count."""
    lines = ["| GPUs | MTBF of the job | plan | intervals | goodput |", "|---|---|---|---|---|"]
    for n in gpu_counts:
        c = Cluster(gpus=n, **cluster)  # type: ignore[arg-type]
        mtbf = 1 / c.rate_per_s
        for p in compare(costs, c):
            iv = ", ".join(f"{t} {_fmt(s)}" for t, s in p.intervals.items())
            lines.append(f"| {n:,} | {_fmt(mtbf)} | {p.name} | {iv} | {p.goodput:.1%} |")
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
