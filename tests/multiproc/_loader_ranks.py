"""Rank functions for torchdata's StatefulDataLoader in a state (imported as ``multiproc._loader_ranks``)."""

from __future__ import annotations

import warnings

import torch

import liferaft
from liferaft.data import GlobalSampler

EPOCH = 64          # samples: 16 batches of 4 per epoch


def shuffled(rank: int, workers: int, seed: int | None = None):
    import multiprocessing

    from torchdata.stateful_dataloader import StatefulDataLoader

    if workers:     # the test launcher's rank processes are daemons, which may not start the loader's workers
        multiprocessing.current_process()._config["daemon"] = False

    g = torch.Generator()
    g.manual_seed(1000 + rank if seed is None else seed)          # a generator per rank: each its own order
    return StatefulDataLoader(list(range(EPOCH)), batch_size=4, shuffle=True, generator=g, num_workers=workers)


class Batches:
    """The loader's batches one after the other, across epochs (a new epoch: a new iterator)."""

    def __init__(self, loader) -> None:
        self.loader, self.it = loader, iter(loader)

    def take(self, n: int) -> list[list[int]]:
        out = []
        while len(out) < n:
            try:
                out.append(next(self.it).tolist())
            except StopIteration:
                self.it = iter(self.loader)
        return out


def train_save_go_on(rank: int, world: int, path: str, workers: int) -> tuple[list, list]:
    """5 batches, save mid-epoch (with a model, as in training), then the epoch's 11 others. (Not into the next
    epoch: torchdata's own state does not carry the generator draws made after an epoch's start, so its next
    epoch differs after any resume, with or without liferaft.)"""
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    loader = shuffled(rank, workers)
    batches = Batches(loader)
    before = batches.take(5)
    liferaft.save(path, {"loader": loader, "model": torch.nn.Linear(2, 2), "step": 5})
    return before, batches.take(11)


def resume(rank: int, world: int, path: str, workers: int) -> list:
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    loader = shuffled(rank, workers, seed=7)        # another seed: the order must come from the checkpoint
    liferaft.load(path, {"loader": loader, "model": torch.nn.Linear(2, 2), "step": 0})
    return Batches(loader).take(11)


def resume_refused(rank: int, world: int, path: str) -> str:
    loader = shuffled(rank, 0)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    try:
        liferaft.load(path, {"loader": loader, "model": model, "step": 0})
    except liferaft.StateMismatchError as e:
        assert torch.equal(model.weight, before)            # refused before anything was loaded
        return str(e)
    return ""


def global_loader(rank: int, world: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = GlobalSampler({"a": 50}, global_batch_size=6, seed=3, rank=rank, world=world)
    return StatefulDataLoader(list(range(50)), batch_sampler=sampler)


def global_save_go_on(rank: int, world: int, path: str) -> list:
    batches = Batches(global_loader(rank, world))
    batches.take(4)
    liferaft.save(path, {"loader": batches.loader})
    return batches.take(6)


def global_resume(rank: int, world: int, path: str) -> list:
    loader = global_loader(rank, world)
    liferaft.load(path, {"loader": loader})
    return Batches(loader).take(6)
