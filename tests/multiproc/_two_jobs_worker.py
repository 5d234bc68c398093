"""A torchrun worker for tests/multiproc/test_two_jobs.py: a 2-rank job saving a tiny state every step.

    torchrun ... _two_jobs_worker.py ROOT LEASE_TTL MODE

MODE "until-released": save steps 0, 1, ... every 0.2 s until the file ROOT.release exists (rank 0 decides, for
both ranks), then two more; at most 300 steps. MODE "crash-once": save steps 0..3; in the first incarnation
(TORCHELASTIC_RESTART_COUNT=0) rank 1 dies right after step 1 is committed. Each rank appends to ROOT.report
``JOB <rank> <restart> <job_id> <seconds the manager took to construct>`` and finally ``DONE <rank> <last step>``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from liferaft import CheckpointManager, JobOptions, PreemptionOptions


def report(root: str, line: str) -> None:
    fd = os.open(root + ".report", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())          # one write: lines of the ranks do not interleave
    finally:
        os.close(fd)


def main() -> None:
    root, ttl, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun keeps one TCPStore across elastic restarts and torch does not separate the incarnations' keys
    # (pytorch/pytorch#135712): a restarted worker can read its peer's address from the previous incarnation and
    # fail to connect. A store prefix per incarnation keeps them apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"incarnation-{restart}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    t0 = time.monotonic()
    # preemption_signals=(): torchrun's SIGTERM (sent to the survivors when a worker dies) ends a worker at once
    mgr = CheckpointManager(root, every_steps=1, async_save=False, preemption=PreemptionOptions(signals=()),
                            job=JobOptions(lease_ttl=ttl))
    report(root, f"JOB {rank} {restart} {mgr.job_id} {time.monotonic() - t0:.2f}")
    state = {"w": torch.zeros(8)}
    start = mgr.restore(state)
    if start is not None:
        assert bool((state["w"] == float(start)).all()), (start, state["w"])
    step = 0 if start is None else start + 1
    last = 3 if mode == "crash-once" else 300
    extra = None                    # steps left after the release (until-released)
    while step <= last:
        state["w"].fill_(float(step))
        mgr.maybe_save(step, state)
        if mode == "crash-once" and restart == 0 and rank == 1 and step == 1:
            os._exit(3)
        if mode == "until-released":
            flag = torch.tensor([int(rank == 0 and os.path.exists(root + ".release"))])
            dist.broadcast(flag, src=0)
            if extra is None and flag.item():
                extra = 2
            elif extra is not None:
                extra -= 1
            if extra == 0:
                break
            time.sleep(0.2)
        step += 1
    mgr.close()
    report(root, f"DONE {rank} {step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
