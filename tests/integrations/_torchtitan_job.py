"""A torchtitan-shaped training job for tests/integrations/test_torchtitan.py, under torchrun on CPU (gloo).

    torchrun --nproc-per-node W _torchtitan_job.py OUT MODE

torchtitan's own components, built from their configs as its trainer builds them: a model sharded with FSDP2
(``fully_shard`` per layer and at the root), the ``OptimizersContainer`` (AdamW, for-loop), the
``LRSchedulersContainer`` (warmup then linear decay), a ``ParallelAwareDataloader`` over a stateful iterable
dataset cut by data-parallel rank, and ``LiferaftCheckpointManager`` built from its ``Config`` with
``config.build(dataloader=, model_parts=, optimizers=, lr_schedulers=, states={"train_state": ...}, sd_adapter=,
base_folder=)``; the loop calls it as torchtitan's ``Trainer.train`` does (``load`` first, ``maybe_wait_for_staging``
before each optimizer step, ``save(step, last_step)`` after it, ``close`` at the end). torchtitan's ``Trainer``
itself is not run: it needs an accelerator (its device type falls back to CUDA on a CPU machine).

MODE "train": 10 steps, a checkpoint every 2 (``async_save=True``, ``keep_latest_k=2``); rank 0 kills itself with
SIGKILL after step 9 (having waited for the save of step 8). MODE "resume": ``load()`` then train to step 10.
MODE "reshard" (another rank count): ``load()`` refused (the loader's position belongs to 2 ranks), the model
unchanged; then a manager with ``exclude_from_loading=["dataloader"]`` loads and training goes on. Rank 0 appends
``{"mode", "world", "step", "loss"}`` to OUT/losses.jsonl, the digest of the full parameters, AdamW state and
schedule after each save (OUT/saved-<step>.json) and after a load (OUT/loaded-<world>.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

from liferaft.errors import StateMismatchError
from liferaft.integrations.torchtitan import LiferaftCheckpointManager

STEPS, KILL_AT, VOCAB, DIM, SEQ = 10, 9, 96, 32, 8


class Tokens(IterableDataset):
    """Sequences drawn by index from a fixed generator, this data-parallel rank's share; stateful (its index)."""

    def __init__(self, dp_rank: int, dp_world: int) -> None:
        self.dp_rank, self.dp_world, self.i = dp_rank, dp_world, 0

    def __iter__(self):
        while True:
            n = self.i * self.dp_world + self.dp_rank
            self.i += 1
            g = torch.Generator().manual_seed(10_000 + n)
            x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield x[:-1], x[1:]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(2))
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(h)


class TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _digest(model, optimizers, schedulers) -> str:
    """Collective (gathers the shards): the full parameters, AdamW state and schedule."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + _full(v).detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    for k, v in sorted(optimizers.state_dict().items()):
        v = _full(v)
        h.update(k.encode() + (v.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                               else repr(v).encode()))
    h.update(repr(schedulers.state_dict()).encode())
    return h.hexdigest()


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    loader = ParallelAwareDataloader(Tokens(rank, world), dp_rank=rank, dp_world_size=world, batch_size=2)
    train_state = TrainState()

    def manager(**kw):
        config = LiferaftCheckpointManager.Config(enable=True, folder="checkpoint", interval=2, async_save=True,
                                                  keep_latest_k=2, last_save_model_only=False, **kw)
        return config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                            lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None,
                            base_folder=out)

    def write(name: str, record: dict) -> None:
        if rank == 0:
            with open(os.path.join(out, name), "a") as f:
                f.write(json.dumps(record) + "\n")

    checkpointer = manager()
    if mode == "reshard":
        before = _digest(model, optimizers, schedulers)
        try:
            checkpointer.load(step=-1)
        except StateMismatchError as e:
            write("refused.json", {"error": str(e), "unchanged": _digest(model, optimizers, schedulers) == before})
        checkpointer.close()
        checkpointer = manager(exclude_from_loading=["dataloader"])
    if mode != "train":
        assert checkpointer.load(step=-1)
        write(f"loaded-{world}.json", {"step": train_state.step, "digest": _digest(model, optimizers, schedulers)})
    it = iter(loader)
    while train_state.step < STEPS:
        train_state.step += 1
        x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += x.numel()
        total = loss.detach().clone()
        dist.all_reduce(total)
        write("losses.jsonl", {"mode": mode, "world": world, "step": train_state.step, "loss": total.item() / world})
        if checkpointer.save(train_state.step, last_step=train_state.step == STEPS):
            digest = _digest(model, optimizers, schedulers)
            write(f"saved-{train_state.step}.json", {"digest": digest})
        if mode == "train" and train_state.step == KILL_AT:
            checkpointer.maybe_wait_for_saving()
            for t in checkpointer._purges:      # (the purge of step 4 runs in the background: let it finish, so
                t.join()                        # that the test sees keep_latest_k applied, not a kill's race)
            dist.barrier()
            if rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
