"""A Hugging Face Trainer job for tests/integrations/test_transformers.py, run under torchrun on CPU (gloo).

    torchrun --nproc-per-node W _trainer_job.py OUT MODEL_DIR MODE [CHECKPOINT]

Fine-tunes the packaged all-MiniLM-L6-v2 as a ``BertForSequenceClassification`` (dropout on) with the Trainer's
AdamW and linear schedule, 2 micro-batches of 2 per step and process (gradient accumulation), 48 sequences, 2
epochs, a checkpoint every 2 steps, ``LiferaftCallback(async_save=True, keep_last=3)``. MODE "train":
rank 0 kills itself with SIGKILL when step KILL_AT is done and logged (after waiting for the save in flight, so that the
newest checkpoint is committed). MODE "resume": ``trainer.train(resume_from_checkpoint=CHECKPOINT)`` (default:
``last_checkpoint(OUT/run)``) to the end. Rank 0 appends ``{"mode", "world", "step", "loss"}`` per step to
OUT/losses.jsonl, the digest of the parameters, AdamW state and schedule at each save to OUT/saved-<step>.json, and
after the resume's load to OUT/loaded-<world>-<step>.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch
import transformers
from transformers import TrainerCallback

from liferaft.integrations.transformers import LiferaftCallback, last_checkpoint

KILL_AT, N, SEQ = 11, 48, 12


def _digest(trainer) -> str:
    h = hashlib.sha256()
    for k, v in sorted(trainer.model.state_dict().items()):
        h.update(k.encode() + v.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    opt = trainer.optimizer.optimizer.state_dict()
    for i, s in sorted(opt["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode() + (v.reshape(-1).view(torch.uint8).numpy().tobytes()
                                            if isinstance(v, torch.Tensor) else repr(v).encode()))
    h.update(repr(trainer.lr_scheduler.state_dict()["last_epoch"]).encode())
    return h.hexdigest()


class _Record(TrainerCallback):
    def __init__(self, trainer, lr, out: str, mode: str) -> None:
        self.trainer, self.lr, self.out, self.mode = trainer, lr, out, mode
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def _write(self, name: str, record: dict) -> None:
        if self.rank == 0:
            with open(os.path.join(self.out, name), "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._write("losses.jsonl", {"mode": self.mode, "world": self.world, "step": state.global_step,
                                         "loss": logs["loss"]})

    def on_save(self, args, state, control, **kwargs):
        if self.rank == 0:
            self._write(f"saved-{state.global_step}.json", {"digest": _digest(self.trainer)})

    def on_train_begin(self, args, state, control, **kwargs):
        if self.mode == "resume" and self.rank == 0:
            self._write(f"loaded-{self.world}-{state.global_step}.json", {"digest": _digest(self.trainer)})

    def on_step_begin(self, args, state, control, **kwargs):
        if self.mode == "train" and state.global_step == KILL_AT and self.rank == 0:
            self.lr.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, folder, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    run = os.path.join(out, "run")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1000, 5000, (N, SEQ), generator=g)
    labels = torch.randint(0, 2, (N,), generator=g)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
            for i in range(N)]
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2)
    args = transformers.TrainingArguments(
        output_dir=run, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=12,
        learning_rate=1e-4, lr_scheduler_type="linear", logging_steps=1, save_strategy="steps", save_steps=2,
        save_only_model=True, report_to=[], use_cpu=True, seed=0, ddp_backend="gloo",
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    lr = LiferaftCallback(trainer, async_save=True, keep_last=3)
    trainer.add_callback(lr)
    trainer.add_callback(_Record(trainer, lr, out, mode))
    resume = None
    if mode == "resume":
        resume = sys.argv[4] if len(sys.argv) > 4 else last_checkpoint(run)
    trainer.train(resume_from_checkpoint=resume)
    if torch.distributed.is_initialized():   # (as a job should: gloo's threads left to the interpreter's
        torch.distributed.destroy_process_group()    # teardown may abort the process, "terminate called ...")


if __name__ == "__main__":
    main()
