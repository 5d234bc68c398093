"""Restarting from memory with the checkpoints' history on an object store: does the restore wait for a LIST?

One process, an S3-compatible server (moto, a subprocess on 127.0.0.1) holding the manager's root and remote tier;
a job of ``--steps`` saves (state ``--size-mib``), its root padded to look like a job of ``--ranks`` ranks (one
data file per rank in every step folder: the keys a LIST walks). Then restarts, alternated ``--reps`` times:

- ``memory first``: the node's memory tier holds the newest step, at least the root's ``INTENT`` (the newest step
  begun there; one small GET): no LIST;
- ``listing first``: the same, ``INTENT`` removed (what every restart did before it: the root and the remote tier
  listed before memory was asked);
- ``root only``: no memory tier, the newest step loaded from the S3 root;
- ``PyTorch DCP``: ``dcp.load`` of the same state from local disk (no object store: DCP has no S3 writer of its own
  here), for scale.

Each row gives ``restore`` alone (DCP: ``load``) and the restart's path: the manager made (it takes the lease; its
clean-up, which lists the root, runs behind) then ``restore``; checked bit-exact; the LIST alone is timed too.
Median [range].

    python benchmarks/bench_memory_first.py [--size-mib 64] [--steps 6] [--ranks 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

from _common import machine, med_range  # sets up the paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import obstore
    import torch
    import torch.distributed.checkpoint as dcp

    from liferaft import CheckpointManager, JobOptions, PreemptionOptions, TierOptions
    from liferaft.manager.listing import INTENT
    from liferaft.storage.s3 import S3Storage
    from liferaft.testing.s3server import MotoS3Server
    from liferaft.tiers.memory import MemoryTier

    n = args.size_mib << 18
    state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(0)), "step": 0}
    quiet, job = PreemptionOptions(signals=()), JobOptions(lease_ttl=60.0)
    work = tempfile.mkdtemp(prefix="bench-memory-first-")
    shm = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"bench-mf-{uuid.uuid4().hex[:8]}")
    with MotoS3Server() as s3:
        os.environ.update(s3.env())
        base = f"s3://{s3.bucket}/{uuid.uuid4().hex[:8]}"
        root, remote = S3Storage(f"{base}/root"), S3Storage(f"{base}/remote")
        tier = lambda: MemoryTier("bench", node="n0", base=shm)
        with CheckpointManager(root, every_steps=1, async_save=False, preemption=quiet, job=job,
                               tiers=TierOptions(tier(), remote=remote)) as mgr:
            for step in range(args.steps):
                state["step"] = step
                mgr.maybe_save(step, state)
        t0 = time.perf_counter()
        for where in (root, remote):            # the other ranks' data files of each step (empty: only keys count)
            for step in range(args.steps):
                for r in range(1, args.ranks):
                    obstore.put(where._store, where._key(f"step-{step:010d}/data/pad/r{r:05d}.pad"), b"")
        pad_s = time.perf_counter() - t0
        keys = len(root.list()) + len(remote.list())
        lists = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            root.list(), remote.list()
            lists.append(time.perf_counter() - t0)
        torch.save(dict(state), os.path.join(work, "ref.pt"))
        dcp_dir = os.path.join(work, "dcp")
        dcp.save(dict(state), checkpoint_id=dcp_dir)
        saved = root.read_all(INTENT)
        times: dict[str, list[float]] = {"memory first": [], "listing first": [], "root only": [], "PyTorch DCP": []}
        restores: dict[str, list[float]] = {k: [] for k in times}
        for _ in range(args.reps):
            for name in times:
                got = {"w": torch.zeros(n), "step": -1}
                if name == "listing first":
                    root.delete(INTENT)
                t0 = time.perf_counter()
                if name == "PyTorch DCP":
                    t1 = t0
                    dcp.load(got, checkpoint_id=dcp_dir)
                    step: Any = got["step"]
                else:
                    tiers = TierOptions(tier(), remote=remote) if name != "root only" else None
                    with CheckpointManager(root, preemption=quiet, job=job, tiers=tiers) as mgr:
                        t1 = time.perf_counter()
                        step = mgr.restore(got)
                        t2 = time.perf_counter()
                restores[name].append(time.perf_counter() - t1 if name == "PyTorch DCP" else t2 - t1)
                times[name].append(time.perf_counter() - t0 if name == "PyTorch DCP" else t2 - t0)
                if name == "listing first":
                    root.put_atomic(INTENT, saved)
                assert step == args.steps - 1 and torch.equal(got["w"], state["w"]), (name, step)
        shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"# {datetime.date.today()} {machine()}")
    print(f"# state {args.size_mib} MiB, {args.steps} steps on S3 (moto on 127.0.0.1), root and remote tier padded "
          f"to {args.ranks} ranks: {keys} keys (padding took {pad_s:.0f} s); LIST of both "
          f"{med_range(lists, '.3f')} s")
    best = statistics.median(times["memory first"])
    print("| restart | restore (s) | manager made + restore (s) | vs memory first |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {med_range(restores[name], '.3f')} | {med_range(ts, '.3f')} | "
              f"{statistics.median(ts) / best:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
