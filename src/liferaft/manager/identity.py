"""Who is writing: the job id of a CheckpointManager, and the facts about processes the lease relies on.

A job id answers one question: is the process that holds a root's lease *this job* (an earlier incarnation of it,
restarting) or *another job*? Getting it wrong one way lets a new job take over a running one's root; the other
way makes a restart wait for its own old lease to go stale. :func:`job_identity` decides, from the environment
and process facts passed in (pure: unit-tested without launchers), in this order:

1. ``job_id=`` given by the user: taken as it is.
2. torchrun's ``TORCHELASTIC_RUN_ID`` when it is a real id: ``--rdzv-id`` set by the user, or the random one
   ``torchrun --standalone`` (and a single-node torchrun without ``--master-port``) makes per launch. Not the
   placeholder ``none`` that every static-rendezvous launch (``--master-addr/--master-port``) and every c10d
   launch without ``--rdzv-id`` share: two such jobs are not one job. -> ``torchrun:<run id>``.
3. Slurm: ``SLURM_JOB_ID`` (``<array job>_<task>`` for an array task) and the step ``SLURM_STEP_ID`` where set
   -> ``slurm:<job>[.<step>]``. A requeued job keeps its job id and numbers its steps from 0 again: the same
   job restarting. A new ``srun`` step in the same allocation is another job (two steps may run at once); a
   step that follows a dead one still takes the lease at once where the dead holder ran on this host.
4. Under torchrun without a real run id: this launch, as the torchrun agent that starts (and restarts) the
   workers -> ``torchrun:<host>:<agent pid>:<agent start time>``. Elastic restarts of the workers keep it; the
   agent's start time tells a reused pid apart.
5. Otherwise a fresh random id per launch -> ``launch:<uuid>``.

Rank 0's id is the job's (the manager broadcasts it).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from liferaft.errors import OptionsError

#: ``TORCHELASTIC_RUN_ID`` values that name no job: torchrun's default for ``--rdzv-id`` is "none".
PLACEHOLDER_RUN_IDS = frozenset({"", "none", "null", "default"})


@dataclass(frozen=True)
class ProcessFacts:
    """A process, told apart from a later one that reuses its pid by its start time (clock ticks after boot,
    ``/proc/<pid>/stat`` field 22; None where unknown)."""

    pid: int
    start: int | None = None


@dataclass(frozen=True)
class JobIdentity:
    job_id: str
    source: str          # "explicit", "torchrun", "slurm", "torchrun-launch" or "launch"


def job_identity(env: Mapping[str, str], *, explicit: str | None = None, host: str = "",
                 launcher: ProcessFacts | None = None,
                 fresh: Callable[[], str] = lambda: uuid.uuid4().hex) -> JobIdentity:
    """The job id by the rules of the module doc. ``env``: the environment; ``host``: this host's name;
    ``launcher``: the torchrun agent process when running under torchrun (see :func:`torchrun_agent`);
    ``fresh``: makes a new random id."""
    if explicit is not None:
        return JobIdentity(explicit, "explicit")
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None and run_id.strip().lower() not in PLACEHOLDER_RUN_IDS:
        return JobIdentity(f"torchrun:{run_id.strip()}", "torchrun")
    slurm_job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if slurm_job:
        array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        job = f"{array}_{task}" if array and task else slurm_job
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        return JobIdentity(f"slurm:{job}" + (f".{step}" if step else ""), "slurm")
    if under_torchrun(env) and launcher is not None:
        start = "" if launcher.start is None else f":{launcher.start}"
        return JobIdentity(f"torchrun:{host}:{launcher.pid}{start}", "torchrun-launch")
    return JobIdentity(f"launch:{fresh()}", "launch")


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this process is a worker started by torchrun's elastic agent."""
    return "TORCHELASTIC_RESTART_COUNT" in env or "TORCHELASTIC_RUN_ID" in env


def validate_job_id(job_id: object) -> str | None:
    """``job_id=`` as given to the manager: None, or a non-empty string."""
    if job_id is None:
        return None
    if not isinstance(job_id, str) or not job_id.strip():
        raise OptionsError(f"job_id must be a non-empty string (or None to derive it), got {job_id!r}")
    return job_id


# ---------------------------------------------------------------------------------------------- process facts


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot (Linux ``/proc``); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])     # field 22; the name (field 2) may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])      # field 4
    except (OSError, ValueError, IndexError):
        return None


def _started_by_torchrun(pid: int) -> bool:
    """Whether process ``pid`` was itself started by torchrun's agent (its environment at exec says so)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0TORCHELASTIC_RESTART_COUNT=" in b"\0" + f.read()
    except OSError:
        return False


def torchrun_agent() -> ProcessFacts:
    """The torchrun agent of this worker: the parent process, or further up where the worker was started
    through a wrapper (``torchrun --no-python wrapper.sh``: processes that torchrun started are skipped)."""
    pid = os.getppid()
    for _ in range(16):
        if pid <= 1 or not _started_by_torchrun(pid):
            break
        up = _parent(pid)
        if up is None:
            break
        pid = up
    return ProcessFacts(pid, process_start(pid))


def machine_key() -> str:
    """What makes two processes' pids comparable: the running kernel (boot id) and the pid namespace. Empty
    where unknown (then the host name alone decides)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def this_job(explicit: str | None) -> JobIdentity:
    """:func:`job_identity` for this process (reads the environment and ``/proc``; call on rank 0)."""
    env = os.environ
    launcher = torchrun_agent() if explicit is None and under_torchrun(env) else None
    return job_identity(env, explicit=explicit, host=socket.gethostname(), launcher=launcher)


__all__ = [
    "PLACEHOLDER_RUN_IDS",
    "JobIdentity",
    "ProcessFacts",
    "job_identity",
    "machine_key",
    "process_start",
    "this_job",
    "torchrun_agent",
    "validate_job_id",
]
