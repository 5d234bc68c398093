"""Job identity (``liferaft.manager.identity``): which environment makes which job id, and what a restart keeps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import liferaft
from liferaft import CheckpointManager, JobOptions, OptionsError
from liferaft.manager.identity import (
    ProcessFacts,
    job_identity,
    machine_key,
    process_start,
    torchrun_agent,
    validate_job_id,
)

AGENT = ProcessFacts(pid=4242, start=987654)
TORCHRUN = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}


def ident(env, explicit=None, launcher=AGENT):
    return job_identity(env, explicit=explicit, host="node7", launcher=launcher, fresh=lambda: "f00d")


@pytest.mark.parametrize("placeholder", ["none", "None", "", " none ", "NULL", "default"])
def test_a_static_rendezvous_run_id_is_no_identity_the_launch_is(placeholder):
    env = {**TORCHRUN, "TORCHELASTIC_RUN_ID": placeholder}
    got = ident(env)
    assert got.job_id == "torchrun:node7:4242:987654" and got.source == "torchrun-launch"
    # two launches (two agents, or a reused agent pid started later) are two jobs
    assert ident(env, launcher=ProcessFacts(4243, 987654)).job_id != got.job_id
    assert ident(env, launcher=ProcessFacts(4242, 999999)).job_id != got.job_id
    # an elastic restart of the workers (same agent) is the same job
    assert ident({**env, "TORCHELASTIC_RESTART_COUNT": "2"}).job_id == got.job_id
    assert ident(env, launcher=ProcessFacts(4242)).job_id == "torchrun:node7:4242"      # no /proc: pid only


def test_a_real_torchrun_run_id_is_the_job():
    for run_id in ["my-run-17", "0b5e3c1e-4f2a-4a36-9d7c-2f1b7f3d7a11"]:     # --rdzv-id, --standalone's uuid
        got = ident({**TORCHRUN, "TORCHELASTIC_RUN_ID": run_id, "SLURM_JOB_ID": "99"})
        assert got.job_id == f"torchrun:{run_id}" and got.source == "torchrun"


def test_slurm_job_array_task_and_step():
    assert ident({"SLURM_JOB_ID": "123"}).job_id == "slurm:123"
    assert ident({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0"}).job_id == "slurm:123.0"
    assert ident({"SLURM_JOBID": "123", "SLURM_STEPID": "4"}).job_id == "slurm:123.4"     # older names
    array = {"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "128", "SLURM_ARRAY_TASK_ID": "2", "SLURM_STEP_ID": "0"}
    assert ident(array).job_id == "slurm:128_2.0" and ident(array).source == "slurm"
    # a requeued job keeps its id and numbers its steps from 0 again: the same job restarting
    assert ident({**array, "SLURM_RESTART_COUNT": "1"}).job_id == ident(array).job_id
    # a new srun step in the allocation is another job
    assert ident({**array, "SLURM_STEP_ID": "1"}).job_id != ident(array).job_id


def test_slurm_comes_before_a_torchrun_launch_without_run_id():
    env = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "55", "SLURM_STEP_ID": "3"}
    assert ident(env).job_id == "slurm:55.3"


def test_explicit_job_id_wins_and_otherwise_a_fresh_id_per_launch():
    env = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "r1", "SLURM_JOB_ID": "9"}
    assert ident(env, explicit="mine").job_id == "mine" and ident(env, explicit="mine").source == "explicit"
    assert ident({}).job_id == "launch:f00d" and ident({}).source == "launch"
    assert ident({}, launcher=None).job_id == "launch:f00d"
    ids = {job_identity({}).job_id for _ in range(3)}
    assert len(ids) == 3                                   # a plain process: a new id per launch
    # the launch rule needs torchrun: TORCHELASTIC_* absent -> no agent-based id even if one is passed
    assert job_identity({}, host="h", launcher=AGENT, fresh=lambda: "x").job_id == "launch:x"


def test_job_id_must_be_a_non_empty_string(tmp_path):
    assert validate_job_id(None) is None and validate_job_id("a") == "a"
    for bad in ["", "   ", 7]:
        with pytest.raises(OptionsError, match="job_id"):
            CheckpointManager(str(tmp_path / "run"), job=JobOptions(job_id=bad))


def test_process_facts_come_from_proc():
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc")
    me = process_start(os.getpid())
    assert isinstance(me, int) and me > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_start(child.pid) is not None and process_start(child.pid) >= me
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None                # gone
    # not under torchrun: the agent is the parent process
    assert torchrun_agent() == ProcessFacts(os.getppid(), process_start(os.getppid()))
    assert machine_key() and "pid:[" in machine_key()


def test_the_agent_is_found_through_a_wrapper_that_torchrun_started(tmp_path):
    """``torchrun --no-python sh -c "python train.py"``: the worker's parent is the shell, its parent the agent."""
    if not os.path.exists("/proc/self/environ"):
        pytest.skip("needs Linux /proc")
    pkg = os.path.dirname(liferaft.__file__)
    code = (f"import sys, types; p = types.ModuleType('liferaft'); p.__path__ = [{pkg!r}]; sys.modules['liferaft'] = p; "
            "from liferaft.manager.identity import torchrun_agent as a; print(a().pid)")    # (no torch import)
    agent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys; env = dict(os.environ, TORCHELASTIC_RESTART_COUNT='0');"
        "r = subprocess.run(['sh', '-c', '\"$PY\" -c \"$CODE\"; true'], env=env, capture_output=True, text=True);"
        "print(os.getpid(), r.stdout.strip(), r.stderr[-500:])")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PY": sys.executable, "CODE": code})
    out, _ = agent.communicate(timeout=120)
    me, found = out.split()[:2]
    assert found == me, out
