"""torchtitan's checkpoint managers side by side: its own (PyTorch DCP) and liferaft's, same job, same state.

Under torchrun, ``--ranks`` processes (gloo, CPU): a model of ``--size-mib`` of fp32 parameters (4 square layers)
sharded with FSDP2, torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` and
``ParallelAwareDataloader``, ``--steps`` steps with a checkpoint every ``--every``, the manager driven as torchtitan's
``Trainer.train`` drives it (``maybe_wait_for_staging`` before each optimizer step, ``save`` after it, ``close`` at
the end). Managers, each built from its ``Config`` with ``config.build(...)``:

- ``DCP`` — torchtitan's ``CheckpointManager`` with ``async_mode="disabled"``;
- ``DCP async`` — the same with ``async_mode="async"`` (``"async_with_pinned_mem"`` needs CUDA);
- ``liferaft`` / ``liferaft async`` — ``LiferaftCheckpointManager`` with ``async_save`` off / on.

Per manager and rep (alternated, reversed every other rep, after an untimed warm-up run): the time the loop spends
inside the manager per save (``save`` plus the next ``maybe_wait_for_staging``, the slowest rank), the run's wall
time less a run without checkpoints, then a restart: a fresh job's ``load()`` of the newest step (the slowest rank),
checked bitwise against the saved parameters; the bytes of one step on disk. The device's limit in the same run:
write + fsync of one step's bytes in one file. Median [range].

    python benchmarks/bench_torchtitan.py [--ranks 2] [--size-mib 64] [--steps 12] [--every 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ENGINES = ["none", "DCP", "DCP async", "liferaft", "liferaft async"]


def _worker(out: str, engine: str, size_mib: int, steps: int, every: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import IterableDataset
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from liferaft.integrations.torchtitan import LiferaftCheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = int((size_mib * 2 ** 20 / 4 / 4) ** 0.5)

    class Rows(IterableDataset):
        def __init__(self) -> None:
            self.i = 0

        def __iter__(self):
            while True:
                self.i += 1
                yield torch.randn(width, generator=torch.Generator().manual_seed(self.i * world + rank))

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    class Train:
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    def job():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opts = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})],
            implementation="foreach").build(model_parts=[model])
        scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=steps)
        loader = ParallelAwareDataloader(Rows(), dp_rank=rank, dp_world_size=world, batch_size=8)
        train = Train()
        common = {"enable": engine != "none", "folder": "ck", "interval": every, "keep_latest_k": 0,
                  "last_save_model_only": False}
        if engine.startswith("DCP"):
            config = CheckpointManager.Config(async_mode="async" if engine.endswith("async") else "disabled",
                                              **common)
        else:
            config = LiferaftCheckpointManager.Config(async_save=engine.endswith("async"), **common)
        ck = config.build(dataloader=loader, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                          states={"train_state": train}, sd_adapter=None, base_folder=out)
        return model, opts, scheds, loader, train, ck

    model, opts, scheds, loader, train, ck = job()
    inside: list[float] = []
    dist.barrier()
    t0 = time.perf_counter()
    it = iter(loader)
    pending = 0.0
    for step in range(1, steps + 1):
        x = next(it)
        model(x).square().mean().backward()
        t = time.perf_counter()
        ck.maybe_wait_for_staging()
        pending += time.perf_counter() - t
        opts.step()
        scheds.step()
        opts.zero_grad()
        train.step = step
        t = time.perf_counter()
        saved = ck.save(step, last_step=False)
        if saved:
            if inside:
                inside[-1] += pending
            inside.append(time.perf_counter() - t)
            pending = 0.0
    t = time.perf_counter()
    ck.maybe_wait_for_saving()
    ck.close()
    tail = time.perf_counter() - t
    dist.barrier()
    wall = time.perf_counter() - t0
    ref = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    load_s = 0.0
    if engine != "none":
        model2, *_rest, ck2 = job()
        dist.barrier()
        t = time.perf_counter()
        assert ck2.load(step=-1)
        load_s = time.perf_counter() - t
        got = {k: v.full_tensor() for k, v in model2.state_dict().items()}
        assert all(torch.equal(got[k], ref[k]) for k in ref), engine
        ck2.close()
    per = torch.tensor([statistics.median(inside) if inside else 0.0, tail, wall, load_s], dtype=torch.float64)
    dist.all_reduce(per, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"inside": per[0].item(), "tail": per[1].item(), "wall": per[2].item(),
                       "load": per[3].item()}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    # A process that loaded through torchtitan's DCP manager aborts in the interpreter's teardown here ("terminate
    # called without an active exception", torch 2.13 CPU; not with liferaft's manager): every engine's worker ends
    # the same way, without a teardown, once its figures are written.
    os._exit(0)


def _run(args: argparse.Namespace, engine: str, out: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(args.ranks), os.path.abspath(__file__), "--worker", out, engine, str(args.size_mib),
                           str(args.steps), str(args.every)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{engine}: {done.stdout[-2000:]}{done.stderr[-6000:]}")
    with open(os.path.join(out, "result.json")) as f:
        r = json.load(f)
    ck = os.path.join(out, "ck")
    steps = sorted(os.listdir(ck)) if os.path.isdir(ck) else []
    r["bytes"] = _bytes(os.path.join(ck, steps[-1])) if steps else 0
    shutil.rmtree(out, ignore_errors=True)
    return r


def _bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return 0
    from _common import machine, med_range, write_fsync_rate  # sets up the paths

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-torchtitan-", dir=os.environ.get("BENCH_DIR"))
    got: dict[str, list[dict]] = {k: [] for k in ENGINES}
    limits: list[float] = []
    _run(args, "none", os.path.join(work, "warm"))
    for rep in range(args.reps):
        for name in ENGINES if rep % 2 == 0 else ENGINES[:1] + ENGINES[:0:-1]:
            got[name].append(_run(args, name, os.path.join(work, name.replace(" ", "_"))))
        limits.append(write_fsync_rate(work, max(r["bytes"] for rs in got.values() for r in rs)))
    shutil.rmtree(work, ignore_errors=True)
    from importlib.metadata import version

    saves = args.steps // args.every
    base = statistics.median(r["wall"] for r in got["none"])
    print(f"# {datetime.date.today()} {machine()} torchtitan {version('torchtitan')}")
    print(f"# {args.ranks} ranks (FSDP2, gloo), {args.size_mib} MiB of parameters + AdamW, {args.steps} steps, a "
          f"checkpoint every {args.every} ({saves} saves); run without checkpoints {med_range([r['wall'] for r in got['none']])} s; "
          f"write + fsync of one step's bytes {med_range(limits)} GB/s; median [range] of {args.reps}")
    print("| manager | one step on disk (MB) | inside the manager per save (s) | wait at close (s) | "
          "run − run without checkpoints (s) | restart load (s) |")
    print("|---|---|---|---|---|---|")
    for name in ENGINES[1:]:
        rs = got[name]
        print(f"| {name} | {rs[-1]['bytes'] / 1e6:.0f} | {med_range([r['inside'] for r in rs])} | "
              f"{med_range([r['tail'] for r in rs])} | {med_range([r['wall'] - base for r in rs])} | "
              f"{med_range([r['load'] for r in rs])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
