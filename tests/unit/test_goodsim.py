"""The goodput model's real inputs (``Machine``, ``costs_at``), its Monte-Carlo simulation (``goodsim``) against the
closed form, and `liferaft plan --simulate` (pure functions and the real command; no timing assertions)."""

from __future__ import annotations

import json
import subprocess

import pytest
from clirun import liferaft_cli

from liferaft.manager.goodput import GIB, Cluster, Costs, Machine, compare, costs_at, evaluate
from liferaft.manager.goodsim import simulate

PER_STEP = {"overhead": 0.04, "step": 0.3, "restore": 2.0, "lost_steps": 0}


def test_costs_follow_the_job_size_where_the_resource_is_shared():
    m = Machine()
    small, big = costs_at(m, Cluster(gpus=16_000)), costs_at(m, Cluster(gpus=64_000))
    # the store's aggregate bandwidth is shared by every GPU of the job: its times grow with the job
    assert big.persist["remote"] - big.stall["remote"] == pytest.approx(4 * (small.persist["remote"] -
                                                                         small.stall["remote"]))
    assert big.restore["remote"] == pytest.approx(4 * small.restore["remote"])
    # a node's memory and its peer's link are not
    assert big.persist["memory"] == small.persist["memory"] and big.restore["peer"] == small.restore["peer"]
    assert big.restart_of("job")["process_groups"] > small.restart_of("job")["process_groups"]
    assert big.restart_of("job")["rendezvous"] > small.restart_of("job")["rendezvous"]
    # a failure that loses a node waits for a replacement; one that kills processes does not
    assert "reschedule" in big.restart_of("node") and "reschedule" in big.restart_of("multi")
    assert "reschedule" not in big.restart_of("job") and "reschedule" not in big.restart_of("storage")
    # a small job: the node's link, not the store, bounds its remote saves
    tiny = costs_at(m, Cluster(gpus=8))
    assert tiny.restore["remote"] == pytest.approx(8 * GIB / m.remote_client_bps)
    # twice the state per GPU: twice every transfer
    double = costs_at(Machine(state_bytes_per_gpu=2 * GIB), Cluster(gpus=16_000))
    assert double.restore["remote"] == pytest.approx(2 * small.restore["remote"])
    assert double.stall["memory"] == pytest.approx(2 * small.stall["memory"])


@pytest.mark.parametrize("gpus", [1_000, 16_000, 100_000])
def test_the_simulation_agrees_with_the_closed_form(gpus):
    cluster = Cluster(gpus=gpus)
    costs = costs_at(Machine(), cluster, PER_STEP)
    plans = compare(costs, cluster)
    assert len(plans) == 4
    for plan in plans:
        sim = simulate(costs, cluster, plan.intervals, horizons=16, seed=3)
        assert abs(sim.goodput - plan.goodput) <= 3 * sim.ci95 + 0.002, (plan.name, sim.goodput, plan.goodput)


def test_every_simulated_second_is_accounted_for_once():
    cluster = Cluster(gpus=100_000)
    costs = costs_at(Machine(), cluster, PER_STEP)
    for plan in compare(costs, cluster):
        sim = simulate(costs, cluster, plan.intervals, horizon_s=5 * 86400, horizons=3, seed=1)
        assert sum(sim.seconds.values()) == pytest.approx(5 * 86400, rel=1e-9)
        assert sim.goodput == pytest.approx(sim.seconds["useful"] / (5 * 86400))
        assert all(v >= 0 for v in sim.seconds.values())
        assert sum(sim.failures.values()) > 100       # ~235 expected in 5 days


def test_the_simulation_is_reproducible_by_its_seed():
    cluster = Cluster(gpus=16_000)
    costs = costs_at(Machine(), cluster)
    iv = {"memory": 30.0, "remote": 120.0}
    a, b = simulate(costs, cluster, iv, seed=7, horizons=2), simulate(costs, cluster, iv, seed=7, horizons=2)
    assert a == b
    assert simulate(costs, cluster, iv, seed=8, horizons=2).seconds != a.seconds


def test_a_storage_outage_costs_a_remote_only_job_its_length_and_a_tiered_job_nothing():
    cluster = Cluster(gpus=16_000, node_share=0.0, multi_node_share=0.0, storage_share=1.0,
                      storage_outage_s=1800.0)
    costs = costs_at(Machine(), cluster)
    remote = evaluate(costs, cluster, {"remote": 60.0})
    tiers = evaluate(costs, cluster, {"memory": 60.0, "remote": 600.0})
    assert remote.recovery["storage"] == "remote" and tiers.recovery["storage"] == "memory"
    assert tiers.goodput - remote.goodput > 0.05           # half an hour per failure every ~3 hours
    sim_r = simulate(costs, cluster, remote.intervals, horizons=4, seed=2)
    sim_t = simulate(costs, cluster, tiers.intervals, horizons=4, seed=2)
    assert sim_r.seconds["storage wait"] > 0.05 * 30 * 86400
    assert sim_t.seconds.get("storage wait", 0.0) == 0.0
    # and remote saves during the outage are lost: a tiered job that resumed keeps saving to memory meanwhile
    assert sim_t.goodput > sim_r.goodput


def test_a_multi_node_failure_loses_the_memory_tier():
    cluster = Cluster(gpus=16_000, node_share=0.0, multi_node_share=1.0, storage_share=0.0)
    costs = costs_at(Machine(), cluster)
    tiers = evaluate(costs, cluster, {"memory": 10.0, "remote": 300.0})
    remote = evaluate(costs, cluster, {"remote": 300.0})
    assert tiers.recovery == {"multi": "remote"}
    # the memory tier only costs here: saving more, recovering as from remote alone
    assert tiers.goodput < remote.goodput
    sim_t = simulate(costs, cluster, tiers.intervals, horizons=8, seed=4)
    sim_r = simulate(costs, cluster, remote.intervals, horizons=8, seed=4)
    assert sim_t.seconds["lost work"] == pytest.approx(sim_r.seconds["lost work"], rel=0.15)
    assert sim_t.goodput < sim_r.goodput


def test_a_failure_during_a_recovery_starts_it_again():
    cluster = Cluster(gpus=100_000)                    # MTBF ~30 min
    costs = Costs(stall={"memory": 0.1, "remote": 0.1}, restore={"memory": 1.0, "peer": 1.0, "remote": 1.0},
                  restart=3600.0)                      # an hour to restart: most recoveries are interrupted
    plan = evaluate(costs, cluster, {"remote": 60.0})
    sim = simulate(costs, cluster, plan.intervals, horizons=4, seed=5)
    assert sim.seconds["interrupted"] > sim.seconds["restart"]
    assert 0.0 <= sim.goodput < 0.2 and plan.goodput < 0.2
    assert abs(sim.goodput - plan.goodput) <= 3 * sim.ci95 + 0.01


def test_fixed_second_costs_still_read_and_simulate():
    costs = Costs(stall={"memory": 0.2, "remote": 0.2}, persist={"remote": 300.0},
                  restore={"memory": 1.0, "peer": 3.0, "remote": 300.0}, restart=60.0)
    cluster = Cluster(gpus=16_000)
    for plan in compare(costs, cluster):
        sim = simulate(costs, cluster, plan.intervals, horizons=8, seed=6)
        assert abs(sim.goodput - plan.goodput) <= 3 * sim.ci95 + 0.002
        assert set(sim.seconds) >= {"useful", "restart", "restore"}


def test_the_per_step_log_with_late_records_agrees_with_the_closed_form():
    cluster = Cluster(gpus=16_000)
    costs = costs_at(Machine(), cluster, {"overhead": 0.05, "step": 1.0, "restore": 2.0, "lost_steps": 4})
    plan = compare(costs, cluster)[3]
    sim = simulate(costs, cluster, plan.intervals, horizons=16, seed=8)
    assert abs(sim.goodput - plan.goodput) <= 3 * sim.ci95 + 0.002
    assert sim.seconds["save stalls"] / (30 * 86400) == pytest.approx(0.05, rel=0.05)     # the overhead, whole


def test_a_one_node_job_has_no_peer():
    cluster = Cluster(gpus=8)
    costs = costs_at(Machine(), cluster)
    plan = evaluate(costs, cluster, {"memory": 60.0, "remote": 600.0})
    assert plan.recovery["node"] == "remote" and plan.recovery["job"] == "memory"
    assert costs.restore["peer"] == pytest.approx(8 * GIB / Machine().peer_restore_bps)
    assert costs_at(Machine(), Cluster(gpus=2)).restore["peer"] == pytest.approx(2 * GIB / Machine().peer_restore_bps)
    sim = simulate(costs, cluster, plan.intervals, horizons=4, seed=9, horizon_s=3650 * 86400.0)
    assert abs(sim.goodput - plan.goodput) <= 3 * sim.ci95 + 0.002


def test_recoveries_longer_than_the_time_between_failures_give_zero_not_an_error():
    cluster = Cluster(gpus=100_000, failures_per_gpu_hour=1.0)
    plan = compare(costs_at(Machine(), cluster), cluster)
    assert [p.goodput for p in plan] == [0.0] * 3


def _plan(*args: str, ok: int = 0) -> subprocess.CompletedProcess:
    out = liferaft_cli("plan", *args, timeout=120)
    assert out.returncode == ok, out.stderr
    if ok:                                            # one line (a usage error: argparse's usage, then one line)
        lines = out.stderr.strip().splitlines()
        assert "Traceback" not in out.stderr and (len(lines) == 1 or ok == 2 and "error:" in lines[-1])
    return out


def test_plan_simulates_and_shows_where_the_time_went(tmp_path):
    out = _plan("--gpus", "16000", "--simulate", "--days", "10", "--horizons", "3")
    rows = [r for r in out.stdout.splitlines() if r.startswith("| 16,000")]
    assert len(rows) == 8                             # 4 plans, twice: goodput and where the time went
    assert "simulated (95 % interval)" in out.stdout and "Where the time went" in out.stdout
    assert "process_groups" in out.stdout and "per-step" in out.stdout
    doc = json.loads(_plan("--gpus", "1000,16000", "--simulate", "--days", "5", "--horizons", "2",
                           "--json").stdout)
    assert len(doc) == 8
    for p in doc:
        assert sum(p["simulated"]["seconds"].values()) == pytest.approx(5 * 86400)
        assert set(p["restart_s"]) == {"job", "node", "multi", "storage"}


def test_plan_scales_a_machine_costs_file(tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"machine": {"launch_s": 1.5, "remote_write_bps": 1e11, "remote_read_bps": 1e11},
                                 "measured": ["launch_s"]}))
    one = json.loads(_plan("--costs", str(costs), "--gpus", "16000", "--json").stdout)[0]
    two = json.loads(_plan("--costs", str(costs), "--gpus", "16000", "--json", "--state-gib", "2").stdout)[0]
    assert two["restore_s"]["remote"] == pytest.approx(2 * one["restore_s"]["remote"])
    assert one["restart_s"]["job"]["launch"] == 1.5
    fast = json.loads(_plan("--costs", str(costs), "--gpus", "16000", "--json", "--remote-gbps", "1000").stdout)[0]
    assert fast["restore_s"]["remote"] == pytest.approx(one["restore_s"]["remote"] / 10)
    assert "measured on this machine: launch_s" in _plan("--costs", str(costs)).stdout


@pytest.mark.parametrize("doc,field", [
    ({"machine": {"launch": 1}}, "launch"),
    ({"machine": {"snapshot_bps": 0}}, "snapshot_bps"),
    ({"machine": {"snapshot_bps": True}}, "snapshot_bps"),
    ({"machine": {"interference": 1.5}}, "interference"),
    ({"machine": {"detect_s": -1}}, "detect_s"),
    ({"machine": [1]}, "machine"),
    ({"machine": {}, "stall": {"memory": 1, "remote": 1}}, "stall"),
    ({"machine": {}, "measured": "launch_s"}, "measured"),
    ({"machine": {}, "measured": ["nothing"]}, "measured"),
    ({"machine": {}, "per_step": {"overhead": 2}}, "per_step"),
    ({"machine": {}, "measured": [{}]}, "measured"),
    ({"machine": {}, "measured": [["launch_s"]]}, "measured"),
])
def test_plan_refuses_a_machine_section_out_of_shape(tmp_path, doc, field):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps(doc))
    out = _plan("--costs", str(costs), ok=1)
    assert "c.json" in out.stderr and field in out.stderr


@pytest.mark.parametrize("args,ok,words", [
    (["--node-share", "0.7", "--multi-node-share", "0.4"], 1, "more than 1"),
    (["--gpus", "10000000", "--simulate"], 1, "fewer"),
    (["--gpus", "1,,2"], 2, "comma list"),
    (["--gpus", "1,2,"], 2, "comma list"),
    (["--gpus", "99999999999"], 2, "at most"),
    (["--gpus", "9" * 5000], 2, "whole number"),
    (["--horizons", "1"], 2, "at least 2"),
    (["--horizons", "100000000", "--simulate", "--gpus", "1"], 2, "at most"),
    (["--gpus", ",".join(["60000"] * 40), "--simulate"], 1, "fewer"),      # each alone would pass: the sum counts
    (["--state-gib", "0"], 2, "--state-gib: must be"),
    (["--days", "nan"], 2, "finite"),
])
def test_plan_refuses_bad_arguments_in_one_line(args, ok, words):
    out = _plan(*args, ok=ok)
    assert words in out.stderr


def test_plan_gives_zero_for_a_job_that_never_recovers(tmp_path):
    doc = json.loads(_plan("--failures-per-gpu-hour", "1", "--gpus", "100000", "--json").stdout)
    assert {p["goodput"] for p in doc} == {0.0}


def test_plan_refuses_to_scale_fixed_seconds(tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"stall": {"memory": 0.2, "remote": 0.2},
                                 "restore": {"memory": 1, "peer": 3, "remote": 300}}))
    out = _plan("--costs", str(costs), "--state-gib", "2", ok=1)
    assert "machine" in out.stderr and "c.json" in out.stderr
