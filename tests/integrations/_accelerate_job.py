"""A Hugging Face Accelerate job for tests/integrations/test_accelerate.py, run under torchrun on CPU (gloo).

    torchrun --nproc-per-node W _accelerate_job.py OUT MODEL_DIR MODE

Fine-tunes the packaged all-MiniLM-L6-v2 (a ``BertModel``) with AdamW and a linear schedule through
``accelerator.prepare`` (DDP); every step's global batch of 6 sequences is drawn from a generator seeded by the step
and each process takes its rows (the same global batch on 1, 2 or 3 processes). MODE "train": steps 0-5, the state
saved with ``liferaft.integrations.accelerate.save_state`` after step 3 (as OUT/step-4, ``extra={"step": 4}``);
rank 0 writes the parameters and optimizer state then to OUT/ref-4.pt. MODE "resume": ``load_state`` of OUT/step-4,
rank 0 writes what it loaded to OUT/loaded-W.pt, then steps 4-5, a final save as OUT/final-W and rank 0 writes the
final parameters to OUT/final-W.pt. Rank 0 appends ``{"mode", "world", "step", "loss"}`` per step to OUT/losses.jsonl.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from accelerate import Accelerator

from liferaft.integrations.accelerate import load_state, save_state

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 4, 6


def _snapshot(model, opt) -> dict:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def main() -> None:
    out, folder, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    acc = Accelerator(cpu=True)
    world, rank = acc.num_processes, acc.process_index
    torch.manual_seed(0)
    model = transformers.BertModel.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    model, opt, sched = acc.prepare(model, opt, sched)
    extra = {"step": 0}
    if mode == "resume":
        load_state(acc, os.path.join(out, f"step-{SAVE_AT}"), extra=extra)
        if rank == 0:
            torch.save({**_snapshot(acc.unwrap_model(model), opt.optimizer), "step": extra["step"],
                        "lr": sched.get_last_lr()[0]}, os.path.join(out, f"loaded-{world}.pt"))
    for step in range(extra["step"], STEPS):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(1000, 5000, (GLOBAL_BATCH, 12), generator=g)[rank::world]
        hidden = model(input_ids=ids)
        loss = hidden.last_hidden_state.pow(2).mean() + hidden.pooler_output.pow(2).mean()   # (every parameter)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        total = acc.reduce(loss.detach(), reduction="mean")
        if rank == 0:
            with open(os.path.join(out, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"mode": mode, "world": world, "step": step, "loss": float(total)}) + "\n")
        if mode == "train" and step + 1 == SAVE_AT:
            save_state(acc, os.path.join(out, f"step-{SAVE_AT}"), extra={"step": SAVE_AT})
            if rank == 0:
                torch.save({**_snapshot(acc.unwrap_model(model), opt.optimizer), "lr": sched.get_last_lr()[0]},
                           os.path.join(out, f"ref-{SAVE_AT}.pt"))
    if mode == "resume":
        handle = save_state(acc, os.path.join(out, f"final-{world}"), extra={"step": STEPS}, async_save=True)
        handle.wait()
        if rank == 0:
            torch.save(_snapshot(acc.unwrap_model(model), opt.optimizer), os.path.join(out, f"final-{world}.pt"))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
