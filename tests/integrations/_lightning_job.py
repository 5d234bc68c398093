"""A PyTorch Lightning job for tests/integrations/test_lightning.py, run under torchrun on CPU (DDP over gloo).

    torchrun --nproc-per-node W _lightning_job.py OUT CKDIR KILL_AT RESUME

A small regression model, 64 fixed samples, batches of 8 per rank, 5 epochs; ``ModelCheckpoint`` every epoch
(``save_top_k=2`` by the epoch's loss, ``save_last=True``) through ``LiferaftCheckpointIO``. Rank 0 appends one JSON
line per training batch to OUT/steps.jsonl (``run``, world, global step, epoch, loss) and, at each epoch's end, the
sum of the parameters to OUT/epochs.jsonl; at the start of fitting every rank appends what it resumed from to
OUT/starts.jsonl. KILL_AT ≥ 0: rank 0 waits for the save in flight, then kills itself with SIGKILL at that global
step. RESUME "last": ``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from liferaft.integrations.lightning import LiferaftCheckpointIO

EPOCHS = 5


class Model(L.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch, _idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


class Record(Callback):
    def __init__(self, out: str, run: str, kill_at: int, io: LiferaftCheckpointIO) -> None:
        self.out, self.run, self.kill_at, self.io = out, run, kill_at, io

    def _write(self, name: str, row: dict) -> None:
        with open(os.path.join(self.out, name), "a") as f:
            f.write(json.dumps({"run": self.run, **row}) + "\n")

    def on_train_start(self, trainer, module):
        params = float(sum(p.detach().double().sum() for p in module.parameters()))
        self._write("starts.jsonl", {"rank": trainer.global_rank, "world": trainer.world_size,
                                     "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                     "params": params, "lr": trainer.optimizers[0].param_groups[0]["lr"]})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            self._write("steps.jsonl", {"world": trainer.world_size, "step": trainer.global_step,
                                        "epoch": trainer.current_epoch, "loss": float(outputs["loss"])})
        if trainer.global_rank == 0 and trainer.global_step == self.kill_at:
            self.io.wait()                       # (the last epoch's checkpoint committed: resumable from it)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self, trainer, module):
        if trainer.global_rank == 0:
            params = float(sum(p.detach().double().sum() for p in module.parameters()))
            self._write("epochs.jsonl", {"epoch": trainer.current_epoch, "step": trainer.global_step,
                                         "params": params})


def main() -> None:
    out, ckdir, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    run = f"{resume}-{os.environ['WORLD_SIZE']}"
    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    data = TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] ** 2)
    io = LiferaftCheckpointIO(async_save=True)         # (the background path, in a real fit)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1,
                        strategy=DDPStrategy(process_group_backend="gloo"), max_epochs=EPOCHS, plugins=[io],
                        callbacks=[ModelCheckpoint(dirpath=ckdir, monitor="train_loss", save_top_k=2, save_last=True,
                                                   every_n_epochs=1),
                                   Record(out, run, kill_at, io)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(Model(), DataLoader(data, batch_size=8, shuffle=True),
                ckpt_path="last" if resume == "last" else None)
    if torch.distributed.is_initialized():   # (as a job should: gloo's threads left to the interpreter's
        torch.distributed.destroy_process_group()    # teardown may abort the process, "terminate called ...")


if __name__ == "__main__":
    main()
