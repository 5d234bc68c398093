"""Rank functions for the data-parallel contract of state dicts and loaders saved over a subgroup (imported as
``multiproc._contract_ranks``)."""

from __future__ import annotations

import torch

import liferaft


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


def ddp_bn_save(rank: int, world: int, path: str) -> list[float]:
    """DDP with BatchNorm, saved as state dicts (the common pattern), next to a plain tensor that differs per
    rank: the running statistics differ between the ranks after a forward, and are replicated by contract."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + rank)
    m(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    liferaft.save(path, {"model": m.module.state_dict(), "optim": opt.state_dict(),
                         "mine": torch.full((3,), float(rank))})
    return m.module[1].running_mean.tolist()


def loader_per_subgroup(rank: int, world: int, root: str) -> tuple[str, int]:
    """Each rank saves and loads its StatefulDataLoader over a subgroup of its own (one replica per rank)."""
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    groups = [dist.new_group([r]) for r in range(world)]
    mine = groups[rank]
    dl = StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True)
    torch.manual_seed(rank)
    it = iter(dl)
    next(it)
    liferaft.save(f"{root}/r{rank}", {"loader": dl}, process_group=mine)
    expected = [b.tolist() for b in [next(it), next(it)]]
    again = StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True)
    liferaft.load(f"{root}/r{rank}", {"loader": again}, process_group=mine)
    got = [b.tolist() for b in list(iter(again))[:2]]
    return ("same" if got == expected else f"differs: {got} vs {expected}"), \
        liferaft.read(f"{root}/r{rank}")["loader"]["liferaft_world_size"]
