"""The Hugging Face Trainer's checkpointing through each engine: how long each save stops training.

One process (CPU): an MLP of ``--size-mib`` of fp32 parameters trained by ``transformers.Trainer`` with its AdamW
(a checkpoint is ~3× that: parameters and two moments), ``--steps`` steps, a checkpoint every ``--every``
(``save_strategy="steps"``, every checkpoint kept). Engines:

- ``Trainer`` — the Trainer's own checkpoint: the model as safetensors, the optimizer, scheduler and RNG with
  ``torch.save`` (the loop waits for all of it);
- ``Trainer + DCP async`` — ``save_only_model=True`` (the Trainer writes the model) and a callback of a few lines
  around ``torch.distributed.checkpoint.async_save`` of the model and optimizer (what a user would write; each
  save waits for the previous one);
- ``Trainer + liferaft`` — ``save_only_model=True`` and ``LiferaftCallback`` (committed when the callback returns);
- ``Trainer + liferaft async`` — ``LiferaftCallback(async_save=True)``.

Per engine and rep (alternated, the order reversed every other rep, after an untimed warm-up fit): the stall of
each save — the time from the end of a checkpointed step to the start of the next, less the median of the same gap
after the steps without a checkpoint — summed with the wait at the end of training, per save; the median time of
the steps without a checkpoint (what a background save costs the steps it overlaps); the peak RSS above the RSS
before the fit; the bytes written. The device's limit in the same run: write + fsync of the Trainer's bytes in one
file. Every engine's last checkpoint is read back and checked against the trained parameters. Median [range].

    python benchmarks/bench_trainer.py [--size-mib 64] [--steps 40] [--every 10] [--reps 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from _common import PeakRss, dir_bytes, machine, med_range, write_fsync_rate  # sets up the paths


def _fit(engine: str, out: str, size_mib: int, steps: int, every: int) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    import liferaft
    from liferaft.integrations.transformers import LiferaftCallback

    width = int((size_mib * 2 ** 20 / 4 / 2) ** 0.5)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x: Any) -> dict[str, Any]:
            return {"loss": (self.b(torch.tanh(self.a(x))) - x).square().mean()}

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ended = 0.0
            self.saving = False
            self.gaps: dict[bool, list[float]] = {True: [], False: []}
            self.steps: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            if self.ended:
                self.gaps[self.saving].append(now - self.ended)
            self.began, self.saving = now, False

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ended = time.perf_counter()
            self.steps.append(self.ended - self.began)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.saving = True

    class DCPAsync(transformers.TrainerCallback):
        def __init__(self, trainer: Any) -> None:
            self.trainer, self.future = trainer, None

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.wait()
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "dcp")
            self.future = dcp.async_save({"model": self.trainer.model.state_dict(),
                                          "optimizer": self.trainer.optimizer.optimizer.state_dict()},
                                         checkpoint_id=path)

        def on_train_end(self, *a: Any, **kw: Any) -> None:
            self.wait()

        def wait(self) -> None:
            if self.future is not None:
                self.future.result()
                self.future = None

    torch.manual_seed(0)
    data = [{"x": torch.randn(width)} for _ in range(steps * 16)]
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=16, max_steps=steps, learning_rate=1e-4,
        save_strategy="steps" if engine != "none" else "no", save_steps=every, logging_strategy="no",
        save_only_model=engine not in ("none", "Trainer"), report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=data)
    if engine == "Trainer + DCP async":
        trainer.add_callback(DCPAsync(trainer))
    elif engine.startswith("Trainer + liferaft"):
        trainer.add_callback(LiferaftCallback(trainer, async_save=engine.endswith("async")))
    clock = Clock()
    trainer.add_callback(clock)
    rss = PeakRss().start()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    tail = time.perf_counter() - clock.ended            # the end of training: the last save's wait
    plain = statistics.median(clock.gaps[False]) if clock.gaps[False] else 0.0
    stall = sum(g - plain for g in clock.gaps[True]) + tail
    peak = rss.stop()
    liferaft.release()          # (liferaft's staging pool lives as long as the process: each fit pays its own)
    return {"wall": wall, "rss": peak, "stall": stall, "step": statistics.median(clock.steps),
            "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def _check(engine: str, folder: str, params: dict[str, Any]) -> None:
    import torch

    import liferaft

    if engine.startswith("Trainer + liferaft"):
        got = liferaft.read(os.path.join(folder, "liferaft"))["model"]
    elif engine == "Trainer + DCP async":
        import torch.distributed.checkpoint as dcp

        holder = {"model": {k: torch.empty_like(v) for k, v in params.items()}}
        dcp.load(holder, checkpoint_id=os.path.join(folder, "dcp"))
        got = holder["model"]
    else:
        from safetensors.torch import load_file

        got = load_file(os.path.join(folder, "model.safetensors"))
        assert os.path.isfile(os.path.join(folder, "optimizer.pt")), folder
    assert all(torch.equal(got[k], v) for k, v in params.items()), engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import transformers

    engines = ["none", "Trainer", "Trainer + DCP async", "Trainer + liferaft", "Trainer + liferaft async"]
    work = tempfile.mkdtemp(prefix="bench-trainer-", dir=os.environ.get("BENCH_DIR"))
    got: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}
    sizes: dict[str, int] = {}
    limits: list[float] = []
    saves = args.steps // args.every
    _fit("none", os.path.join(work, "warm"), args.size_mib, args.steps, args.every)
    for rep in range(args.reps):
        for name in engines if rep % 2 == 0 else engines[:1] + engines[:0:-1]:
            out = os.path.join(work, name.replace(" ", "_"))
            shutil.rmtree(out, ignore_errors=True)
            r = _fit(name, out, args.size_mib, args.steps, args.every)
            got[name].append(r)
            if name == "none":
                continue
            sizes[name] = dir_bytes(out)
            _check(name, os.path.join(out, f"checkpoint-{args.steps}"), r.pop("params"))
            shutil.rmtree(out, ignore_errors=True)
        limits.append(write_fsync_rate(work, sizes.get("Trainer", 0)))
    shutil.rmtree(work, ignore_errors=True)
    none = got["none"]
    print(f"# {datetime.date.today()} {machine()} transformers {transformers.__version__}")
    print(f"# Trainer.train, 1 process, {args.size_mib} MiB of parameters + AdamW, {args.steps} steps, a checkpoint "
          f"every {args.every} ({saves} saves); train without checkpoints {med_range([r['wall'] for r in none])} s, "
          f"a step {med_range([r['step'] * 1e3 for r in none])} ms; write + fsync of the Trainer's bytes "
          f"{med_range(limits)} GB/s; median [range] of {args.reps}")
    print("| engine | written per save (MB) | training stopped per save (s) | step without a save (ms) | "
          "train − train without checkpoints (s) | peak extra RSS (MB) |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(r["wall"] for r in none)
    for name in engines[1:]:
        rs = got[name]
        print(f"| {name} | {sizes[name] / saves / 1e6:.0f} | {med_range([r['stall'] / saves for r in rs])} | "
              f"{med_range([r['step'] * 1e3 for r in rs])} | {med_range([r['wall'] - base for r in rs])} | "
              f"{statistics.median(r['rss'] for r in rs) / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
