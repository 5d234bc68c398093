"""A PyTorch Lightning FSDP2 job for tests/integrations/test_lightning.py, under torchrun on CPU (gloo).

    torchrun --nproc-per-node W _lightning_fsdp_job.py OUT CKDIR KILL_AT RESUME

``LiferaftModelParallelStrategy`` (data-parallel size W, tensor-parallel size 1): the module's ``configure_model``
shards each layer and the root with ``fully_shard`` over the strategy's data-parallel mesh; AdamW with a StepLR
schedule; 64 fixed samples, batches of 8 per rank (a ``DistributedSampler`` from the strategy), 4 epochs;
``ModelCheckpoint`` every epoch (``save_last=True``). Rank 0 appends one JSON line per batch to OUT/steps.jsonl
(run, world, global step, loss). At the start of fitting and after each epoch, every rank takes part in gathering
the full parameters and AdamW state, and rank 0 appends their digest to OUT/digests.jsonl. KILL_AT ≥ 0: rank 0
kills itself with SIGKILL at that global step. RESUME "last": ``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from liferaft.integrations.lightning import LiferaftModelParallelStrategy

EPOCHS = 4


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _digest(trainer, module) -> str:
    """Collective: the full parameters and AdamW state, and the learning rate."""
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode() + _full(v).detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    for p, st in sorted(((p, opt.state[p]) for g in opt.param_groups for p in g["params"] if p in opt.state),
                        key=lambda e: names[id(e[0])]):
        for k, v in sorted(st.items()):
            h.update(f"{names[id(p)]}.{k}".encode() + _full(v).reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(opt.param_groups[0]["lr"]).encode())
    return h.hexdigest()


class Record(Callback):
    def __init__(self, out: str, run: str, kill_at: int) -> None:
        self.out, self.run, self.kill_at = out, run, kill_at

    def _write(self, trainer, name: str, row: dict) -> None:
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, name), "a") as f:
                f.write(json.dumps({"run": self.run, **row}) + "\n")

    def on_train_start(self, trainer, module):
        self._write(trainer, "digests.jsonl", {"at": "start", "step": trainer.global_step,
                                               "digest": _digest(trainer, module)})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._write(trainer, "steps.jsonl", {"world": trainer.world_size, "step": trainer.global_step,
                                             "loss": float(outputs["loss"])})
        if trainer.global_rank == 0 and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self, trainer, module):
        self._write(trainer, "digests.jsonl", {"at": "epoch", "step": trainer.global_step,
                                               "digest": _digest(trainer, module)})


def main() -> None:
    out, ckdir, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    world = int(os.environ["WORLD_SIZE"])
    run = f"{resume}-{world}"
    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    data = TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] ** 2)
    strategy = LiferaftModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                             process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_epochs=EPOCHS,
                        callbacks=[ModelCheckpoint(dirpath=ckdir, save_top_k=-1, save_last=True, every_n_epochs=1),
                                   Record(out, run, kill_at)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(Model(), DataLoader(data, batch_size=8, shuffle=True),
                ckpt_path="last" if resume == "last" else None)
    if torch.distributed.is_initialized():   # (as a job should: gloo's threads left to the interpreter's
        torch.distributed.destroy_process_group()    # teardown may abort the process, "terminate called ...")


if __name__ == "__main__":
    main()
