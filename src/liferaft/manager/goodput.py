"""When to save, and what it buys: the Young/Daly interval and a goodput model of tiered checkpointing (pure).

Young (1974) / Daly (2006): with a checkpoint costing ``C`` seconds of lost training time and a mean time between
failures ``M``, the interval that maximizes useful work is ``τ = sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) − C``
(``τ = M`` when ``C ≥ 2M``); a tier's interval is never shorter than its persist time.

Goodput (the share of wall time that is useful training) of a job with one save schedule per tier, to first order:
every save of tier t costs its stall ``s_t`` and, while it persists in the background, ``interference`` of the
step time, every ``τ_t`` seconds; a failure of class c (``FAILURE_CLASSES``: the job's processes, one node, several
nodes at once, the shared storage) happens at rate ``λ_c`` and costs its restart (``Costs.restart_parts``: detection,
rescheduling, launch, rendezvous, process groups, first step), the restore from the newest copy that survives it,
the wait for the storage when that copy is remote and the storage is down, and on average ``τ/2 + persist`` of
recomputed work (the age of the newest durable save of that tier):
``goodput = 1 − Σ_t (s_t + ι·(p_t − s_t))/τ_t − Σ_c λ_c (restart_c + restore + wait + τ/2 + p)``, floored at 0.
``manager.goodsim`` simulates the same job failure by failure (and failures during a recovery, which this first-order
form ignores) and agrees with it where both apply.

The costs come from ``Machine`` (``costs_at``): bytes of state per GPU, the bandwidths of each tier (the remote
store's aggregate bandwidth shared by the whole job, so its persist and restore times grow with the GPU count) and
the restart's parts (rendezvous and process groups grow with the nodes and the GPUs), or as fixed seconds
(``Costs`` given directly, as the ``--costs`` files of `liferaft plan` before these inputs existed).

With measured per-step costs (``Costs.per_step``: the per-step log's step-time overhead, the step time, the time
from a restart to the first step and the steps a failure loses), a fourth plan: every step recoverable for the
failures memory and its peer replicas cover, and remote saves at their interval for the multi-node failures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Failure classes: ``job`` (processes die, every node's memory intact: software, NCCL timeouts), ``node`` (one
#: node's memory lost: a GPU, its memory, the host), ``multi`` (several nodes at once: a switch, a rack; a peer
#: replica may be gone with its node), ``storage`` (the shared store fails: the job stops and the remote tier is
#: unreadable and unwritable for ``Cluster.storage_outage_s``).
FAILURE_CLASSES = ("job", "node", "multi", "storage")
#: Where each class can restore from, per tier: the place (its restore cost), or absent when the class loses it.
SURVIVORS: Mapping[str, Mapping[str, str]] = {
    "job": {"memory": "memory", "step": "step", "remote": "remote"},
    "node": {"memory": "peer", "step": "step", "remote": "remote"},
    "multi": {"remote": "remote"},
    "storage": {"memory": "memory", "step": "step", "remote": "remote"},
}
#: Parts of a restart (seconds), in order; ``reschedule`` only for classes that lose a node.
RESTART_PARTS = ("detect", "reschedule", "launch", "rendezvous", "process_groups", "first_step")


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
    """Costs in seconds: the training stall of one save per tier, the time until it is durable, the restore from
    each place, the restart (a fixed ``restart`` for every class, or ``restart_parts``: class → part → seconds),
    the share of step time a save persisting in the background costs (``interference``)."""

    stall: Mapping[str, float]                       # tier → seconds of training lost per save ("memory", "remote")
    restore: Mapping[str, float]                     # "memory", "peer", "remote" → seconds
    restart: float = 120.0
    persist: Mapping[str, float] = field(default_factory=dict)   # tier → seconds until a save is durable there
    #: the per-step log, measured: "overhead" (share of step time), "step" (s), "restore" (s), "lost_steps"
    per_step: Mapping[str, float] | None = None
    restart_parts: Mapping[str, Mapping[str, float]] | None = None
    interference: float = 0.0

    def interval(self, tier: str, mtbf_s: float) -> float:
        """Young/Daly for the tier's stall, but never shorter than its persist time (a save cannot start before
        the previous one is durable)."""
        return max(young_daly(self.stall[tier], mtbf_s), self.persist.get(tier, 0.0))

    def restart_of(self, cls: str) -> Mapping[str, float]:
        """The parts of a restart after a failure of class ``cls`` (seconds each; ``{"restart": s}`` when fixed)."""
        if self.restart_parts is None:
            return {"restart": self.restart}
        return self.restart_parts[cls]

    def tier(self, name: str) -> tuple[float, float]:
        """(stall, persist) of one save of tier ``name`` ("memory", "remote", or "step": the per-step log, whose
        stall is its overhead share of a step and whose newest record is durable ``lost_steps`` steps late)."""
        if name == "step":
            ps = self.per_step or {}
            return ps["overhead"] * ps["step"], ps["lost_steps"] * ps["step"]
        s = self.stall[name]
        return s, max(s, self.persist.get(name, 0.0))

    def restore_from(self, place: str) -> float:
        if place == "step":
            return (self.per_step or {})["restore"]
        return self.restore[place]


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` per node; ``failures_per_gpu_hour`` in all, shared among the classes of
    ``FAILURE_CLASSES``: ``node_share``, ``multi_node_share``, ``storage_share``, and the job class the rest.

    Defaults from the Llama 3 report (419 unexpected interruptions in 54 days on 16,384 GPUs: 1.97e-5 per GPU-hour;
    GPU, HBM, host and NIC faults 315 of them, a node each; network switches and cables 35, several nodes;
    software, NCCL and silent data corruption 67, the job; 2 "dependency" ones, taken as the storage) and an
    assumed 30-minute outage of the shared store."""

    gpus: int
    failures_per_gpu_hour: float = 1.97e-5
    node_share: float = 315 / 419
    multi_node_share: float = 35 / 419
    gpus_per_node: int = 8
    storage_share: float = 2 / 419
    storage_outage_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.node_share + self.multi_node_share + self.storage_share > 1 + 1e-9:
            raise ValueError("node_share + multi_node_share + storage_share must be at most 1 (the job class "
                             "takes the rest)")

    @property
    def rate_per_s(self) -> float:
        return self.gpus * self.failures_per_gpu_hour / 3600.0

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def shares(self) -> dict[str, float]:
        """Each failure class's share of the failures (summing to 1)."""
        rest = max(0.0, 1 - self.node_share - self.multi_node_share - self.storage_share)
        return {"job": rest, "node": self.node_share, "multi": self.multi_node_share,
                "storage": self.storage_share}


GIB = float(1 << 30)


@dataclass(frozen=True)
class Machine:
    """The inputs that set the costs at any job size (``costs_at``): bytes of state each GPU saves, bandwidths in
    bytes/s (``snapshot`` and ``memory_restore`` per GPU; ``replica``, ``peer_restore`` and ``remote_client`` per
    node; ``remote_write`` and ``remote_read`` the store's aggregate, shared by every node of the job), the
    restart's parts in seconds (``rendezvous`` and ``process_groups`` plus a part per node and per GPU), and the
    share of step time a save persisting in the background costs. Defaults: ``DEFAULT_MACHINE`` (the sources are
    listed in docs/cli/plan.md); ``benchmarks/bench_goodput_costs.py`` measures those this machine can."""

    state_bytes_per_gpu: float = GIB
    snapshot_bps: float = 20e9
    replica_bps: float = 25e9
    memory_restore_bps: float = 20e9
    peer_restore_bps: float = 25e9
    remote_write_bps: float = 2e12
    remote_read_bps: float = 2e12
    remote_client_bps: float = 25e9
    detect_s: float = 30.0
    reschedule_s: float = 60.0
    launch_s: float = 20.0
    rendezvous_s: float = 2.0
    rendezvous_per_node_s: float = 0.01
    process_groups_s: float = 5.0
    process_groups_per_gpu_s: float = 0.002
    first_step_s: float = 30.0
    interference: float = 0.02


def costs_at(m: Machine, cluster: Cluster, per_step: Mapping[str, float] | None = None) -> Costs:
    """The costs of ``m`` at ``cluster``'s size: a save's stall is the snapshot of the GPU's bytes; the memory
    tier is durable once the node's bytes reached a peer over the node's link; the remote tier once the whole job's
    bytes went through the store (its aggregate bandwidth, or the node's link if slower); restores likewise from
    the GPU's own memory, a peer node, the store. Restart parts per class, ``reschedule`` only when a node is lost."""
    b, node = m.state_bytes_per_gpu, m.state_bytes_per_gpu * min(cluster.gpus, cluster.gpus_per_node)
    job = b * cluster.gpus
    stall = b / m.snapshot_bps
    persist = {"memory": stall + node / m.replica_bps,
               "remote": stall + max(job / m.remote_write_bps, node / m.remote_client_bps)}
    restore = {"memory": b / m.memory_restore_bps, "peer": node / m.peer_restore_bps,
               "remote": max(job / m.remote_read_bps, node / m.remote_client_bps)}
    common = {"detect": m.detect_s, "launch": m.launch_s,
              "rendezvous": m.rendezvous_s + m.rendezvous_per_node_s * cluster.nodes,
              "process_groups": m.process_groups_s + m.process_groups_per_gpu_s * cluster.gpus,
              "first_step": m.first_step_s}
    parts = {c: {p: (m.reschedule_s if p == "reschedule" else common[p]) for p in RESTART_PARTS
                 if p != "reschedule" or c in ("node", "multi")} for c in FAILURE_CLASSES}
    return Costs(stall={"memory": stall, "remote": stall}, restore=restore, persist=persist,
                 restart=sum(parts["job"].values()), per_step=per_step, restart_parts=parts,
                 interference=m.interference)


@dataclass(frozen=True)
class Plan:
    name: str
    intervals: Mapping[str, float]                   # tier → seconds between saves
    goodput: float
    breakdown: Mapping[str, float] = field(default_factory=dict)
    #: failure class → the place it restores from under this plan (recomputed by ``goodsim`` failure by failure)
    recovery: Mapping[str, str] = field(default_factory=dict)


def _age(costs: Costs, tier: str, tau: float, lam: float = 0.0) -> float:
    """Expected work a failure loses when it restores from ``tier``: the age of its newest durable save. Saves
    start every ``tau`` seconds after the (re)start, each durable ``persist`` later, and the state a run started
    from counts as saved; with failures at rate ``lam`` the run lasts ``X ~ Exp(lam)`` and loses ``X − k·tau``,
    ``k`` the newest save durable by then: ``E = 1/λ − τ·e^{−λp} / (e^{λτ} − 1)``, which is ``τ/2 + p`` when
    failures are rare (``lam = 0``) and tends to the whole run when ``τ`` is long beside ``1/λ``. The per-step log
    is a tier saving every step, each record durable ``lost_steps`` steps late (the step in progress is lost too)."""
    _, persist = costs.tier(tier)
    if tier != "step":
        tau = max(tau, persist)
    if lam <= 0 or lam * tau < 1e-6:
        return tau / 2 + persist
    if lam * tau > 700:                      # (e^{λτ} overflows: no save ever completes)
        return 1 / lam
    return 1 / lam - tau * math.exp(-lam * persist) / math.expm1(lam * tau)


def survivors(cls: str, nodes: int) -> Mapping[str, str]:
    """Tier → the place a failure of class ``cls`` restores it from (``SURVIVORS``), in a job of ``nodes`` nodes:
    with one node there is no peer, and a lost node takes the memory tier with it."""
    out = SURVIVORS[cls]
    if nodes < 2 and cls == "node":
        return {t: p for t, p in out.items() if t == "remote"}
    return out


def best_place(costs: Costs, cls: str, tiers: Sequence[str], intervals: Mapping[str, float],
               outage: float = 0.0, lam: float = 0.0, nodes: int = 2) -> tuple[str, str, float]:
    """(tier, place, expected seconds) of the cheapest recovery from a failure of class ``cls`` among the plan's
    ``tiers``: restore + the storage's outage if the place is remote and the class is ``storage`` + the work lost
    since the tier's newest durable save."""
    best: tuple[str, str, float] | None = None
    for tier in tiers:
        place = survivors(cls, nodes).get(tier)
        if place is None:
            continue
        wait = outage if cls == "storage" and place == "remote" else 0.0
        cost = costs.restore_from(place) + wait + _age(costs, tier, intervals[tier], lam)
        if best is None or cost < best[2]:
            best = (tier, place, cost)
    if best is None:
        raise ValueError(f"no tier of {list(tiers)} survives a failure of class {cls!r}")
    return best


def saving_share(costs: Costs, intervals: Mapping[str, float]) -> float:
    """The share of time saves cost: stalls, and the interference while each persists in the background."""
    out = 0.0
    for tier, tau in intervals.items():
        if tau <= 0:
            continue
        stall, persist = costs.tier(tier)
        if tier == "step":
            out += costs.per_step["overhead"] if costs.per_step else 0.0
        else:
            out += (stall + costs.interference * (persist - stall)) / max(tau, persist)
    return out


def evaluate(costs: Costs, cluster: Cluster, intervals: Mapping[str, float], name: str = "") -> Plan:
    """Goodput of saving tier t every ``intervals[t]`` seconds, each failure class recovering from the cheapest
    place that survives it (``best_place``), to first order (module docstring)."""
    lam = cluster.rate_per_s
    saving = saving_share(costs, intervals)
    lost = down = 0.0
    recovery = {}
    for cls, share in cluster.shares.items():
        if share <= 0:
            continue
        tier, place, cost = best_place(costs, cls, list(intervals), intervals, cluster.storage_outage_s, lam,
                                       cluster.nodes)
        recovery[cls] = place
        age = _age(costs, tier, intervals[tier], lam)
        lost += share * age
        down += share * (sum(costs.restart_of(cls).values()) + cost - age)
    return _renewal(name, intervals, saving, lam, lost, down, recovery)


def _renewal(name: str, intervals: Mapping[str, float], saving: float, lam: float, lost: float, down: float,
             recovery: Mapping[str, str]) -> Plan:
    """The plan's goodput from the saving share, the failure rate, the mean work a failure loses and the mean
    recovery (restart + restore + wait): per failure cycle, ``1/λ`` of training (``saving`` of it spent saving)
    and ``lost`` of it redone, then a recovery that a failure during it starts again (its mean length
    ``(e^{λR} − 1)/λ``): ``goodput = (1 − saving − λ·lost) / (1 + λ·E[recovery])`` (renewal-reward; to first order
    the module's ``1 − saving − λ(lost + R)``)."""
    if lam * down > 700:                     # (e^{λR} overflows: recoveries never finish between failures)
        return Plan(name=name, intervals=dict(intervals), goodput=0.0,
                    breakdown={"saving": saving, "failures": math.inf}, recovery=dict(recovery))
    rec = math.expm1(lam * down) / lam if lam > 0 else down
    value = (1 - saving - lam * lost) / (1 + lam * rec)
    return Plan(name=name, intervals=dict(intervals), goodput=max(0.0, value),
                breakdown={"saving": saving, "failures": lam * (lost + rec)}, recovery=dict(recovery))


def goodput(costs: Costs, cluster: Cluster, intervals: Mapping[str, float], recovery: Mapping[str, str]) -> Plan:
    """Goodput of saving tier t every ``intervals[t]`` seconds; ``recovery`` maps each failure class ("job",
    "node", "multi", and "storage", which defaults to the job's) to the place it restores from ("memory", "peer",
    "remote"), whose tier's interval sets the lost work ("memory"/"peer" → tier "memory")."""
    lam = cluster.rate_per_s
    saving = saving_share(costs, intervals)
    lost = down = 0.0
    for cls, share in cluster.shares.items():
        where = recovery.get(cls, recovery["job"])
        tier = "memory" if where in ("memory", "peer") else "remote"
        wait = cluster.storage_outage_s if cls == "storage" and where == "remote" else 0.0
        lost += share * _age(costs, tier, intervals[tier], lam)
        down += share * (sum(costs.restart_of(cls).values()) + costs.restore[where] + wait)
    return _renewal("", intervals, saving, lam, lost, down, {c: recovery.get(c, recovery["job"])
                                                               for c in cluster.shares})


def compare(costs: Costs, cluster: Cluster, fixed_remote_s: float = 3600.0) -> list[Plan]:
    """Three ways to run the same job: remote saves at a fixed interval (no tiers, ``fixed_remote_s``), remote
    only at its Young/Daly interval, and liferaft's memory tier (+ peer replicas) at its Young/Daly interval for
    the failures it covers plus remote at the interval for the failures only remote covers; with
    ``costs.per_step``, a fourth: the per-step log and remote saves."""
    lam = cluster.rate_per_s
    out = [evaluate(costs, cluster, {"remote": max(fixed_remote_s, costs.tier("remote")[1])},
                    "no tiers: remote every %.0f min" % (fixed_remote_s / 60))]
    out.append(evaluate(costs, cluster, {"remote": costs.interval("remote", 1 / lam)},
                        "remote only, Young/Daly interval"))
    shares = cluster.shares
    covered = lam * (1 - shares["multi"])
    tau_mem = costs.interval("memory", 1 / covered) if covered > 0 else 24 * 3600.0
    tau_remote = costs.interval("remote", 1 / (lam * shares["multi"])) if shares["multi"] > 0 else 24 * 3600.0
    out.append(evaluate(costs, cluster, {"memory": tau_mem, "remote": tau_remote},
                        "liferaft tiers: memory + peer replicas, remote; auto intervals"))
    if costs.per_step is not None:
        out.append(per_step_plan(costs, cluster, tau_remote))
    return out


def per_step_plan(costs: Costs, cluster: Cluster, tau_remote: float) -> Plan:
    """The per-step log as measured (``costs.per_step``): job, node and storage failures resume from the last step
    (lose ``lost_steps`` steps, pay ``restore``), multi-node failures from remote saves every ``tau_remote``
    seconds."""
    ps = costs.per_step or {}
    return evaluate(costs, cluster, {"step": ps["step"], "remote": tau_remote},
                    "liferaft per-step log (measured): every step recoverable, remote")
