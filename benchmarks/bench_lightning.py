"""PyTorch Lightning's checkpointing through each engine: what ``Trainer.fit`` loses to its checkpoints.

One process (``devices=1``, CPU): an MLP of ``--size-mib`` of fp32 parameters trained with AdamW (a checkpoint is
~3× that: parameters and two moments), ``--steps`` steps, a checkpoint every ``--every`` steps by ``ModelCheckpoint``
(``save_top_k=-1``, no ``last.ckpt``: one save per checkpoint). Engines, each ``Trainer(plugins=[...])``:

- ``torch.save`` — Lightning's default ``TorchCheckpointIO`` (the loop waits for the write);
- ``Lightning async`` — ``AsyncCheckpointIO()`` (its thread: the tensors cloned, then ``torch.save``);
- ``PyTorch DCP async`` — a ``CheckpointIO`` of five lines around ``torch.distributed.checkpoint.async_save`` (what a
  user would write; each save waits for the previous one);
- ``liferaft`` — ``LiferaftCheckpointIO()`` (each save committed when it returns, as Lightning's own);
- ``liferaft async`` — ``LiferaftCheckpointIO(async_save=True)``.

Per engine and rep (alternated): the fit's wall time, less a fit without checkpoints in the same rep = the cost of
the checkpoints to training (the final save's wait at teardown included), per save (after an untimed fit: the
first of a process is slower; the engines' order reversed every other rep); the peak RSS above the RSS
before the fit; the bytes written. The device's limit in the same run: write + fsync of the same bytes into one
file. Every engine's last checkpoint is loaded back and checked against the trained parameters. Median [range].

    python benchmarks/bench_lightning.py [--size-mib 64] [--steps 40] [--every 10] [--reps 2]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from _common import PeakRss, dir_bytes, machine, med_range, write_fsync_rate  # sets up the paths


def _engines() -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from liferaft.integrations.lightning import LiferaftCheckpointIO

    class DCPAsync(CheckpointIO):
        def __init__(self) -> None:
            self.future: Any = None

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            self.teardown()
            self.future = dcp.async_save(checkpoint, checkpoint_id=str(path))

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
            raise NotImplementedError

        def remove_checkpoint(self, path: Any) -> None:
            shutil.rmtree(path, ignore_errors=True)

        def teardown(self) -> None:
            if self.future is not None:
                self.future.result()
                self.future = None

    return {"none": None, "torch.save": TorchCheckpointIO, "Lightning async": AsyncCheckpointIO,
            "PyTorch DCP async": DCPAsync, "liferaft": LiferaftCheckpointIO,
            "liferaft async": functools.partial(LiferaftCheckpointIO, async_save=True)}


def _fit(engine: Any, ckdir: str, size_mib: int, steps: int, every: int) -> tuple[float, int, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    width = int((size_mib * 2 ** 20 / 4 / 2) ** 0.5)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))

        def training_step(self, batch: Any, _i: int) -> Any:
            return (self.net(batch[0]) - batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    L.seed_everything(0)
    data = TensorDataset(torch.randn(steps * 16, width))
    cbs = [ModelCheckpoint(dirpath=ckdir, every_n_train_steps=every, save_top_k=-1)] if engine else []
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[engine()] if engine else None,
                        callbacks=cbs, enable_checkpointing=bool(engine), logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    rss = PeakRss().start()
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=16))
    wall = time.perf_counter() - t0
    return wall, rss.stop(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import torch

    import liferaft

    engines = _engines()
    work = tempfile.mkdtemp(prefix="bench-lightning-", dir=os.environ.get("BENCH_DIR"))
    walls: dict[str, list[float]] = {k: [] for k in engines}
    rsss: dict[str, list[float]] = {k: [] for k in engines}
    sizes: dict[str, int] = {}
    limits: list[float] = []
    saves = args.steps // args.every
    _fit(None, work, args.size_mib, args.steps, args.every)          # (warm-up: the first fit of a process is slower)
    for rep in range(args.reps):
        order = list(engines.items())
        for name, engine in order if rep % 2 == 0 else order[:1] + order[:0:-1]:
            ckdir = os.path.join(work, name.replace(" ", "_"))
            shutil.rmtree(ckdir, ignore_errors=True)
            wall, rss, params = _fit(engine, ckdir, args.size_mib, args.steps, args.every)
            walls[name].append(wall)
            rsss[name].append(rss)
            if engine is None:
                continue
            sizes[name] = dir_bytes(ckdir)
            last = os.path.join(ckdir, max(os.listdir(ckdir), key=lambda n: int(n.split("step=")[1][:-5])))
            if name.startswith("liferaft"):
                got = liferaft.read(last)["state_dict"]
            elif name == "PyTorch DCP async":
                import torch.distributed.checkpoint as dcp

                holder = {"state_dict": {k: torch.empty_like(v) for k, v in params.items()}}
                dcp.load(holder, checkpoint_id=last)
                got = holder["state_dict"]
            else:
                got = torch.load(last, weights_only=True)["state_dict"]
            assert all(torch.equal(got[k], v) for k, v in params.items()), name
        limits.append(write_fsync_rate(work, sizes.get("torch.save", 0)))
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(walls["none"])
    print(f"# {datetime.date.today()} {machine()}")
    print(f"# Trainer.fit, 1 process, {args.size_mib} MiB of parameters + AdamW, {args.steps} steps, a checkpoint "
          f"every {args.every} ({saves} saves); fit without checkpoints {med_range(walls['none'])} s; write + fsync "
          f"of the same bytes {med_range(limits)} GB/s; median [range] of {args.reps}")
    print("| engine | checkpoint size (MB) | fit − fit without checkpoints (s) | per save (s) | peak extra RSS (MB) |")
    print("|---|---|---|---|---|")
    for name in engines:
        if name == "none":
            continue
        over = [w - base for w in walls[name]]
        print(f"| {name} | {sizes[name] / saves / 1e6:.0f} | {med_range(over)} | "
              f"{statistics.median(over) / saves:.3f} | {statistics.median(rsss[name]) / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
