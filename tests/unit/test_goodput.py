"""The Young/Daly interval, the goodput model, every_seconds="auto" and `liferaft plan` (pure functions and a real
manager on local files; no timing assertions)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft import CheckpointManager, SavePolicy
from liferaft.manager.goodput import Cluster, Costs, compare, goodput, young_daly
from liferaft.manager.policies import AutoInterval, mtbf_from_starts


def test_young_daly_matches_the_first_order_formula_for_cheap_checkpoints():
    c, m = 10.0, 86400.0
    assert young_daly(c, m) == pytest.approx(math.sqrt(2 * c * m), rel=0.02)
    assert young_daly(c, m) > young_daly(c, m / 4)          # rarer failures: save less often
    assert young_daly(100.0, 40.0) == 100.0                  # cost beyond 2·MTBF: capped
    assert young_daly(0.0, 1000.0) == 0.0


def test_the_interval_is_the_optimum_of_the_goodput_model():
    costs = Costs(stall={"remote": 30.0}, restore={"remote": 60.0}, restart=60.0)
    cluster = Cluster(gpus=16000)
    best = young_daly(30.0, 1 / cluster.rate_per_s)
    remote = {"job": "remote", "node": "remote", "multi": "remote"}
    g = {f: goodput(costs, cluster, {"remote": best * f}, remote).goodput for f in (0.5, 1.0, 2.0)}
    assert g[1.0] > g[0.5] and g[1.0] > g[2.0]


def test_tiers_win_when_the_remote_tier_is_slow_and_failures_are_frequent():
    costs = Costs(stall={"memory": 0.2, "remote": 0.2}, persist={"memory": 2.0, "remote": 600.0},
                  restore={"memory": 1.0, "peer": 3.0, "remote": 600.0}, restart=60.0)
    plans = compare(costs, Cluster(gpus=100000))
    fixed, remote_best, tiers = (p.goodput for p in plans)
    assert tiers > remote_best > fixed
    assert plans[2].intervals["memory"] < plans[1].intervals["remote"]


def test_auto_interval_follows_measured_costs_and_learned_failure_rate():
    auto = AutoInterval(mtbf_s=3600.0)
    auto.record(stall_s=2.0, persist_s=10.0)
    assert auto.interval_s == pytest.approx(young_daly(2.0, 3600.0))
    auto.record(stall_s=2.0, persist_s=500.0)                 # slow persistence bounds the interval from below
    assert auto.interval_s >= auto.persist_s > 10.0
    assert mtbf_from_starts([0.0, 100.0], 3600.0, 200.0) == 3600.0          # too few restarts: the prior
    assert mtbf_from_starts([0.0, 100.0, 200.0, 300.0], 300.0, 300.0) == pytest.approx(150.0)


def test_manager_every_seconds_auto_records_starts_and_recomputes(tmp_path):
    root = str(tmp_path / "run")
    model = torch.nn.Linear(64, 64)
    liferaft.save(str(tmp_path / "warm-up"), {"model": model})  # (the first save of a process imports torch.dcp)
    for _ in range(3):
        with CheckpointManager(root, async_save=False, save_policy=SavePolicy(every_seconds="auto")) as mgr:
            first = mgr.interval_s                            # from a guessed 1 s stall
            mgr.maybe_save(0, {"model": model}, force=True)   # this small save stalls far less: save more often
            assert 1.0 <= mgr.interval_s < first
    starts = json.loads((tmp_path / "run" / "STARTS").read_text())
    assert len(starts) == 3 and starts == sorted(starts)
    auto_1h = SavePolicy(every_seconds="auto", mtbf_hours=1.0)
    with CheckpointManager(root, async_save=False, save_policy=auto_1h) as mgr:
        assert mgr.interval_s == pytest.approx(young_daly(1.0, 3600.0))


def test_plan_command_prints_the_three_plans_at_each_scale(tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"stall": {"memory": 0.2, "remote": 0.2}, "persist": {"remote": 300},
                                 "restore": {"memory": 1, "peer": 3, "remote": 300}, "restart": 60}))
    out = liferaft_cli("plan", "--costs", str(costs), "--gpus", "1000,100000", timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1")]
    assert len(rows) == 6 and sum("liferaft tiers" in r for r in rows) == 2


PER_STEP = {"overhead": 0.02, "step": 0.2, "restore": 15.0, "lost_steps": 1}


def test_per_step_plan_loses_one_step_per_covered_failure_and_pays_its_overhead():
    base = {"stall": {"memory": 0.15, "remote": 0.15}, "restore": {"memory": 0.6, "peer": 2.0, "remote": 20.0},
            "restart": 0.0}
    cluster = Cluster(gpus=100000, multi_node_share=0.0)
    plans = compare(Costs(**base, per_step=PER_STEP), cluster)
    assert [p.name for p in plans[:3]] == [p.name for p in compare(Costs(**base), cluster)]   # three, unchanged
    ps = plans[3]
    assert "per-step" in ps.name and ps.intervals["step"] == 0.2
    lam = cluster.rate_per_s                       # no multi-node failures: only overhead and one step + restore
    recovery = math.expm1(lam * 15.0) / lam        # (a failure during the 15 s recovery starts it again)
    lost = 0.2 + 0.2 / 2                           # the lost step, and half the step in progress
    assert ps.breakdown["failures"] == pytest.approx(lam * (lost + recovery), rel=1e-3)
    assert ps.goodput == pytest.approx((1 - 0.02 - 0.15 / ps.intervals["remote"] - lam * lost) / (1 + lam * recovery),
                                       rel=1e-4)
    free = compare(Costs(**base, per_step={**PER_STEP, "overhead": 0.0, "restore": 0.6}), cluster)
    assert free[3].goodput > free[2].goodput       # free per-step beats interval saves (no lost half-interval)


def test_plan_command_shows_the_per_step_plan_from_a_costs_file(tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"stall": {"memory": 0.2, "remote": 0.2}, "restore": {"memory": 1, "peer": 3,
                                 "remote": 300}, "per_step": PER_STEP}))
    out = liferaft_cli("plan", "--costs", str(costs), "--gpus", "1000,100000", timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1")]
    assert len(rows) == 8 and sum("per-step log" in r for r in rows) == 2
    assert "per_step {'overhead': 0.02" in out.stdout


@pytest.mark.parametrize("per_step", [
    [], "fast", None, {**PER_STEP, "overhead": 1.5}, {**PER_STEP, "overhead": -0.1}, {**PER_STEP, "step": 0},
    {**PER_STEP, "lost_steps": True}, {**PER_STEP, "restore": "15"}, {**PER_STEP, "extra": 1},
    {k: v for k, v in PER_STEP.items() if k != "step"}, {**PER_STEP, "lost_steps": 1e7}])
def test_plan_refuses_a_per_step_section_out_of_shape_or_range(tmp_path, per_step):
    from liferaft.cli.plan import load_costs
    from liferaft.errors import LiferaftError

    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"stall": {"memory": 0.2, "remote": 0.2}, "restore": {"memory": 1, "peer": 3,
                                 "remote": 300}, "per_step": per_step}))
    with pytest.raises(LiferaftError, match=r"c\.json.*per_step"):
        load_costs(str(costs))
    costs.write_text(costs.read_text().replace('"per_step": ', '"per_step": {"overhead": NaN}, "x": '))
    with pytest.raises(LiferaftError, match="c.json"):
        load_costs(str(costs))


_BIG = "9" * 400


@pytest.mark.parametrize("text,field", [
    ('{"stall":{"memory":0.1,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1},'
     '"per_step":{"overhead":0.01,"step":1,"restore":BIG,"lost_steps":1}}'.replace("BIG", _BIG), "per_step.restore"),
    ('{"stall":{"memory":BIG,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1}}'.replace("BIG", _BIG), "stall.memory"),
    ('{"stall":{"memory":0.1,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1},"restart":-BIG}'.replace("BIG", _BIG),
     "restart"),
    ('{"stall":{"memory":0.1,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1},'
     '"per_step":{"overhead":0.01,"step":1,"restore":1,"lost_steps":1,"overhead":0.5}}', "overhead"),
    ('{"stall":{"memory":0.1,"remote":0.1},"stall":{"memory":0.1,"remote":0.1},'
     '"restore":{"memory":1,"peer":1,"remote":1}}', "stall"),
    ('{"stall":{"memory":1e400,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1}}', "1e400"),
    ('{"stall":{"memory":BIG,"remote":0.1},"restore":{"memory":1,"peer":1,"remote":1}}'.replace("BIG", "9" * 5000), "JSON"),
], ids=["bigint_per_step", "bigint_stall", "bigint_negative_restart", "dup_key_per_step", "dup_key_top",
        "float_overflow", "int_beyond_cpython"])
def test_plan_refuses_huge_numbers_and_duplicate_keys_naming_the_field(tmp_path, text, field):
    """Any integer size, float overflow or key given twice is a one-line OptionsError naming the file and field."""
    from liferaft.cli.plan import load_costs
    from liferaft.errors import OptionsError

    costs = tmp_path / "c.json"
    costs.write_text(text)
    with pytest.raises(OptionsError, match=r"c\.json") as e:
        load_costs(str(costs))
    assert field in str(e.value) and len(str(e.value)) < 500 and "\n" not in str(e.value)
    out = liferaft_cli("plan", "--costs", str(costs), timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr and field in out.stderr


def test_plan_accepts_integers_in_range(tmp_path):
    from liferaft.cli.plan import load_costs

    costs = tmp_path / "c.json"
    costs.write_text('{"stall":{"memory":0,"remote":1},"restore":{"memory":1,"peer":1,"remote":1000000000},'
                     '"restart":60,"per_step":{"overhead":0,"step":1,"restore":1,"lost_steps":1000000}}')
    assert load_costs(str(costs))["restore"]["remote"] == 10 ** 9


def test_auto_interval_for_failures_that_cost_only_a_replay_is_longer():
    """A failure that costs a share ``loss`` of the work since the last save (the per-step log: its replay) moves
    Young/Daly's optimum to that of failures 1 / loss times rarer; the share is clamped (0, negative, NaN, > 1)."""
    import math

    from liferaft.manager.policies import MIN_LOSS

    auto = AutoInterval(mtbf_s=3600.0)
    auto.record(stall_s=0.05, persist_s=0.2)
    full = auto.interval_s
    auto.loss = 0.01
    assert auto.interval_s == pytest.approx(young_daly(0.05, 360000.0)) and auto.interval_s > 9 * full
    for odd, same in ((0.0, MIN_LOSS), (-1.0, MIN_LOSS), (5.0, 1.0), (math.nan, 1.0)):
        auto.loss = odd
        assert auto.interval_s == pytest.approx(young_daly(0.05, 3600.0 / same)), odd


def test_replay_share_measures_the_step_against_the_time_between_records():
    from liferaft.tiers.stepshare import ReplayShare

    share = ReplayShare(smoothing=0.5)
    share.record(0.0)                       # the first record: nothing to compare with
    share.step(0.8)
    share.step(0.9)                         # (a second optimizer step of the same record: the first counts)
    share.record(1.0)
    assert share.value == pytest.approx(0.2)
    share.record(2.0)                       # a record without an optimizer step (a skipped step): no sample
    assert share.value == pytest.approx(0.2)
    share.step(2.5)
    share.record(3.0)
    assert share.value == pytest.approx(0.5 * 0.2 + 0.5 * 0.5)
    share.step(2.0)                         # a clock before the last record: no sample
    share.record(4.0)
    assert share.value == pytest.approx(0.35)


def test_the_per_step_log_stretches_the_memory_tiers_auto_interval(tmp_path):
    """With the per-step log on, a failure the memory tier covers costs the records' replay, not the work: the
    manager hands the log's measured replay share to the memory tier's Young/Daly interval, which grows."""
    from liferaft import MemoryTier, StepLogOptions, TierOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}

    def train(mgr: CheckpointManager, steps: range, every: int = 1) -> None:
        for step in steps:
            for _ in range(20):             # a forward and backward the replay does not redo
                model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % every == 0:
                mgr.maybe_save(step, state)

    def manager(name: str, log_replicas: int, memory_replicas: int = 1) -> CheckpointManager:
        tier = MemoryTier(name, node="n0", base=str(tmp_path / "shm"), replicas=memory_replicas)
        return CheckpointManager(str(tmp_path / name), every_steps=10 ** 6, async_save=False,
                                 save_policy=SavePolicy(every_seconds="auto", mtbf_hours=1.0),
                                 tiers=TierOptions(memory=tier, memory_every="auto", drain=False),
                                 step_log=StepLogOptions(replicas=log_replicas, max_steps=16))

    with manager("covered", 1) as mgr:
        mgr.restore(state)
        assert mgr._tiers is not None and mgr._tiers.auto is not None and mgr._auto is not None
        plain = AutoInterval(mtbf_s=mgr._tiers.auto.mtbf_s)
        train(mgr, range(6))
        share = mgr._steplog.replay_share
        assert share is not None and 0 < share < 0.5 and mgr._tiers.auto.loss == share
        plain.stall_s, plain.persist_s = mgr._tiers.auto.stall_s, mgr._tiers.auto.persist_s
        assert mgr._tiers.auto.interval_s > plain.interval_s
        assert mgr._auto.loss == 1.0        # the root's interval: not stretched (it is for what memory loses)
        with pytest.warns(UserWarning, match="maybe_save was not called"):
            train(mgr, range(6, 10), every=2)           # a hole in the chain: the work is lost, not replayed
        assert mgr._steplog.replay_share is None and mgr._tiers.auto.loss == 1.0
        train(mgr, range(10, 15))
        assert mgr._tiers.auto.loss == 1.0
        mgr.save(14, state)                 # a full checkpoint past the hole: replayable again
        train(mgr, range(15, 18))
        assert mgr._steplog.replay_share is not None and mgr._tiers.auto.loss == mgr._steplog.replay_share < 1
    with manager("uncovered", 0) as mgr:    # no replica of the records, one of the memory tier's copies
        mgr.restore(state)
        train(mgr, range(6))
        assert mgr._steplog.replay_share is not None and mgr._tiers.auto.loss == 1.0


def test_replay_share_is_none_while_the_chain_has_a_hole_and_for_cuda_records():
    from liferaft.tiers.stepshare import ReplayShare

    share = ReplayShare(smoothing=1.0)
    share.record(0.0)
    share.step(0.5)
    share.record(1.0)
    assert share.value == pytest.approx(0.5)
    share.spoil(7)
    assert share.value is None
    share.durable(6)
    assert share.value is None              # a full checkpoint before the hole does not mend it
    share.durable(7)
    assert share.value == pytest.approx(0.5)
    share.blind = True
    assert share.value is None


def test_loop_cost_counts_what_the_steps_lost_while_a_save_ran():
    """A save's cost for Young/Daly is the time the loop lost while it ran (its stall included), against quiet
    steps: at least its stall, at most stall + its time to durability, an interval at most its stall and one quiet
    step (an evaluation meanwhile is not the save's); intervals with another save in flight (the memory tier's)
    count for neither, nor does the interval in which a save was accounted for; a new save starts from zero."""
    from liferaft.manager.policies import LoopCost

    loop = LoopCost(smoothing=0.5)
    t = 0.0
    for _ in range(6):                      # quiet steps of 100 ms
        loop.call(t, busy=False)
        t += 0.1
    assert loop.quiet == pytest.approx(0.1)
    loop.call(t, busy=False)                # (the call that starts the save)
    loop.started()
    for dt in (0.14, 0.13, 0.12):           # the stall's step, then two steps slowed by the background
        t += dt
        loop.call(t, busy=True, stall=0.02)
    assert loop.cost(stall_s=0.02, persist_s=1.0) == pytest.approx(0.09)
    t += 0.5                                # the interval in which it was accounted for: not a quiet step
    loop.call(t, busy=False)
    assert loop.quiet == pytest.approx(0.1)
    for dt in (0.3, 0.3):                   # another save in flight (the memory tier's): neither quiet nor lost
        t += dt
        loop.call(t, busy=False, other=True)
    assert loop.quiet == pytest.approx(0.1)
    loop.started()
    t += 0.1
    loop.call(t, busy=True, stall=0.03)     # (a save that cost nothing beyond noise): its stall at least
    assert loop.cost(stall_s=0.03, persist_s=1.0) == pytest.approx(0.03)
    t += 0.1
    loop.call(t, busy=False)
    loop.started()
    t += 30.0                               # an evaluation while a save ran: at most its stall and one step
    loop.call(t, busy=True, stall=0.03)
    t += 0.25
    loop.call(t, busy=True, stall=0.03)     # (and a step it slowed)
    assert loop.cost(stall_s=0.03, persist_s=5.0) == pytest.approx(0.13 + 0.13)
    t += 0.1
    loop.call(t, busy=False)
    loop.started()
    t += 0.3                                # a save that failed: its loss is not the next one's
    loop.call(t, busy=True, stall=0.2)
    loop.started()
    assert loop.cost(stall_s=0.01, persist_s=1.0) == pytest.approx(0.01)


def test_the_auto_interval_learns_the_loops_loss_not_only_the_stall(tmp_path):
    """With every_seconds="auto" and async saves, the cost the interval is computed from is what the loop lost
    while the save ran, which is at least the stall (a slow step in flight makes it larger)."""
    model = torch.nn.Linear(256, 256)
    state = {"model": model}
    liferaft.save(str(tmp_path / "warm-up"), state)      # (the first save of a process imports torch.dcp)
    with CheckpointManager(str(tmp_path / "run"), async_save=True,
                           save_policy=SavePolicy(every_seconds="auto", mtbf_hours=1.0)) as mgr:
        assert mgr._auto is not None
        for step in range(8):
            if step == 4:
                time.sleep(0.5)             # a step slower than the quiet ones while the save of step 3 runs
            mgr.maybe_save(step, state, force=step == 3)
        mgr.wait()
        assert mgr._auto.saves == 1         # (the one forced: the first auto interval is a minute or more)
        # the slow step ran while the save was in flight: its loss is counted, up to the save's own time (its
        # stall and its time to durability); the stall alone was the cost before
        assert mgr._saves.stall < mgr._auto.stall_s <= mgr._saves.stall + mgr._auto.persist_s + 1e-9
