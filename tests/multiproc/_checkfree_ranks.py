"""Rank functions for tests/multiproc/test_checkfree.py: one pipeline stage per rank (a small MLP block each, the
same shapes on every stage), some of them lost."""

from __future__ import annotations

from typing import Any

import torch

import liferaft


def stage(rank: int, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(100 + rank)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
    m.register_buffer("count", torch.tensor(rank * 10))
    return m


def rebuild(rank: int, world: int, lost: list[int], weights: str, width: int = 16) -> dict[str, Any]:
    """Every stage trains one step (its gradients set), the stages in ``lost`` are replaced by fresh modules and
    rebuilt; returns every stage's tensors after it, its gradient norm before, and the report."""
    m = stage(rank, width)
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(4, m[0].in_features, generator=torch.Generator().manual_seed(rank))
    m(x).square().mean().backward()
    norm = float(sum(p.grad.double().pow(2).sum() for p in m.parameters()) ** 0.5)
    opt.step()
    if rank in lost:
        torch.manual_seed(999)
        m = stage(rank)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(123.0)
        opt = torch.optim.AdamW(m.parameters())
        opt.state[next(m.parameters())] = {"exp_avg": torch.zeros(1)}
    report = liferaft.rebuild_stage(m, lost=rank in lost, optimizer=opt, weights=weights)
    return {"tensors": {k: v.detach().clone().numpy() for k, v in m.state_dict().items()}, "norm": norm,
            "report": report, "opt_state": len(opt.state)}


def mismatch(rank: int, world: int) -> None:
    m = stage(rank, 16 if rank != 2 else 8)
    liferaft.rebuild_stage(m, lost=rank == 1)
