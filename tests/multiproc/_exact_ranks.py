"""Rank functions for the exact-resume test (imported as ``multiproc._exact_ranks``): a small GPT-style model
with dropout, FSDP2 over the ranks, AdamW + LR schedule, data from ``liferaft.data.GlobalSampler``, RNG in
``liferaft.RNGState``, checkpoints by ``CheckpointManager``."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn

import liferaft
from liferaft import JobOptions
from liferaft.data import GlobalSampler

VOCAB, SEQ, DIM = 64, 12, 32
SOURCES = {"prose": 96, "code": 40}
WEIGHTS = {"prose": 0.7, "code": 0.3}


class TinyGPT(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=dropout, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos
        for b in self.blocks:
            x = b(x, src_mask=self.mask, is_causal=True)
        return self.head(x)


def tokens(source: str, index: int) -> torch.Tensor:
    """The dataset: sample ``index`` of ``source``, a pure function (any rank can make any sample)."""
    g = torch.Generator().manual_seed((1 + list(SOURCES).index(source)) * 100_003 + index)
    return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)


def build(world: int, dropout: float = 0.1, tp: int = 1) -> dict[str, Any]:
    """FSDP2 over all ranks, or with ``tp`` > 1 FSDP2 over ``world // tp`` data-parallel groups on top of tensor
    parallelism (each block's MLP: linear1 column-wise, linear2 row-wise) on a 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT(dropout)
    rank = torch.distributed.get_rank()
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh2 = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        plan = {f"blocks.{i}.linear1": ColwiseParallel() for i in range(len(model.blocks))}
        plan.update({f"blocks.{i}.linear2": RowwiseParallel() for i in range(len(model.blocks))})
        parallelize_module(model, mesh2["tp"], plan)
        mesh, dp_rank, dp = mesh2["dp"], mesh2["dp"].get_local_rank(), world // tp
    else:
        mesh, dp_rank, dp = init_device_mesh("cpu", (world,)), rank, world
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    data = GlobalSampler(SOURCES, weights=WEIGHTS, global_batch_size=8, seed=5, rank=dp_rank, world=dp)
    torch.manual_seed(1000 + rank)                     # per-rank dropout streams
    return {"model": model, "optim": opt, "sched": sched, "data": data, "rng": liferaft.RNGState(), "step": 0}


def train(state: dict[str, Any], start: int, end: int, mgr: Any = None, die_after: int | None = None) -> list[float]:
    """Steps [start, end); the global mean loss of each step (bitwise comparable)."""
    model, opt, sched = state["model"], state["optim"], state["sched"]
    batches = state["data"].batches()
    losses = []
    for step in range(start, end):
        batch = torch.stack([tokens(s.source, s.index) for s in next(batches)])
        logits = model(batch[:, :-1]).clone()
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state["step"] = step + 1
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / torch.distributed.get_world_size())
        if mgr is not None:
            mgr.maybe_save(step, state)
            if step == die_after:
                mgr.wait()                              # the step-``die_after`` checkpoint is committed
                os.kill(os.getpid(), signal.SIGKILL)    # then the job "crashes"
    return losses


def params(state: dict[str, Any]) -> dict[str, list[float]]:
    """This rank's shards of the parameters and of AdamW's moments (bitwise comparable)."""
    out = {f"p.{k}": v.to_local().flatten().tolist() for k, v in state["model"].state_dict().items()}
    for j, s in enumerate(state["optim"].state.values()):       # parameter order
        for n, t in s.items():
            if t.dim():
                out[f"o.{j}.{n}"] = t.to_local().flatten().tolist()
    return out


def run_straight(rank: int, world: int, steps: int) -> tuple[list[float], dict]:
    torch.set_num_threads(1)
    state = build(world)
    return train(state, 0, steps), params(state)


def run_until_crash(rank: int, world: int, root: str, steps: int, crash_at: int) -> None:
    torch.set_num_threads(1)
    state = build(world)
    mgr = liferaft.CheckpointManager(root, every_steps=5, job=JobOptions(job_id="exact"),
                                     save_options=liferaft.SaveOptions(timeout=60))
    train(state, 0, steps, mgr, die_after=crash_at)


def resume(rank: int, world: int, root: str, steps: int) -> tuple[int, list[float], dict]:
    torch.set_num_threads(1)
    state = build(world)
    with liferaft.CheckpointManager(root, every_steps=5, job=JobOptions(job_id="exact"),
                                    save_options=liferaft.SaveOptions(timeout=60)) as mgr:
        last = mgr.restore(state)
        assert last is not None and state["step"] == last + 1
        losses = train(state, last + 1, steps, mgr)
    return last, losses, params(state)


def full_params(state: dict[str, Any]) -> dict[str, list[float]]:
    """Gathered parameters and AdamW moments keyed by parameter name (layout-independent, bitwise comparable)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    out = {f"p.{k}": full(v).flatten().tolist() for k, v in get_model_state_dict(state["model"], options=o).items()}
    for k, s in get_optimizer_state_dict(state["model"], state["optim"], options=o)["state"].items():
        for n, t in s.items():
            out[f"o.{k}.{n}"] = full(t).flatten().tolist()
    return out


def save_then_crash(rank: int, world: int, root: str, steps: int) -> tuple[list[float], dict]:
    """No dropout (a new layout gets new RNG streams); train ``steps`` steps, save, return losses and the full
    state as saved; the caller's next job loads it on another number of ranks."""
    torch.set_num_threads(1)
    state = build(world, dropout=0.0)
    losses = train(state, 0, steps)
    liferaft.save(root, state, options=liferaft.SaveOptions(timeout=60))
    return losses, full_params(state)


def load_on_new_layout(rank: int, world: int, root: str, steps: int, more: int,
                       tp: int = 1) -> tuple[dict, list[float]]:
    """Load on ``world`` ranks (``tp`` > 1: FSDP2 + TP); return the full state right after the load and the losses
    of ``more`` steps."""
    torch.set_num_threads(1)
    state = build(world, dropout=0.0, tp=tp)
    liferaft.load(root, state, options=liferaft.LoadOptions(timeout=60))
    assert state["step"] == steps
    after = full_params(state)
    return after, train(state, steps, steps + more)


def run_straight_no_dropout(rank: int, world: int, steps: int) -> list[float]:
    torch.set_num_threads(1)
    return train(build(world, dropout=0.0), 0, steps)
