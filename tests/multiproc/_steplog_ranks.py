"""Rank functions for the per-step log tests (imported as ``multiproc._steplog_ranks``): a small training job under
DDP or FSDP2 with AdamW or SGD(momentum), two micro-batches per step, gradient clipping, a GradScaler that skips
one step (an inf gradient forced at ``INF_STEP``), an LR scheduler, dropout (RNG), a buffer updated every step and
a data position — checkpointed by a manager with full checkpoints every ``EVERY`` steps and the per-step log in
between; it may ``kill -9`` itself right after ``maybe_save`` of a chosen step."""

from __future__ import annotations

import os
import random
import signal
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

import liferaft
from liferaft import CheckpointManager, JobOptions, MemoryTier, StepLogOptions, TierOptions

EVERY = 4           # full checkpoints at steps 0, 4, 8, ...
INF_STEP = 5        # the GradScaler skips this step (an inf gradient)


class Position:
    """The data position: samples consumed so far (a stateful object)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.samples = sd["samples"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(32, 4)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.b(self.drop(torch.relu(self.a(x))))


class Mixed(nn.Module):
    """A DDP part (the same gradients on every rank) beside a part whose gradients differ between the ranks (each
    computes them from its own data, no all-reduce). Its parameters must stay the same on every rank (a full
    checkpoint keeps one copy of a plain tensor), so its optimizer group has lr 0 and no momentum: what matters is
    that its gradients differ. No buffers (the per-step log's cheap walk of the rest of the state)."""

    def __init__(self) -> None:
        super().__init__()
        self.ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
        self.side = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = torch.distributed.get_rank()
        return self.ddp(x) + self.side(x * (rank + 1)) * 0.1


def build(kind: str, opt_name: str, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    np.random.seed(0)           # every stream of RNGState starts the same in every run
    random.seed(0)
    net = Net() if kind != "mixed" else Mixed()
    if kind == "mixed":
        model: nn.Module = net
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(net.a, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    params: Any = list(model.parameters())
    if kind == "mixed":
        params = [{"params": list(net.ddp.parameters())},
                  {"params": list(net.side.parameters()), "lr": 0.0, "momentum": 0.0, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if opt_name == "adamw" else \
        torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    return {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "pos": Position(),
            "rng": liferaft.RNGState()}


def train_step(st: dict[str, Any], rank: int, step: int) -> float:
    model, opt, scaler = st["model"], st["optim"], st["scaler"]
    total = 0.0
    for micro in range(2):
        g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro + st["pos"].samples % 7)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y) / 2
        scaler.scale(loss).backward()
        total += float(loss.detach())
        st["pos"].samples += 6
    if step == INF_STEP:
        with torch.no_grad():
            p = next(iter(model.parameters()))
            p.grad.fill_(float("inf"))
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.ddp.parameters() if isinstance(model, Mixed) else model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "lr_scheduler.step() before optimizer.step()" after the skipped step
        st["sched"].step()
    return total


def snapshot(st: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state (local shards: dtype, shape, bytes), the RNG streams and the plain values."""
    from liferaft.state.flatten import flatten

    flat = flatten(st)
    out = {}
    for leaf in flat.tensors:
        for i, (_, t) in enumerate(leaf.parts):
            t = t.detach().contiguous()           # bytes: bitwise (and picklable across processes)
            out[f"{leaf.key}/{i}"] = (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    for key, _, v in flat.values:
        out[key] = repr(v)
    return out


def job(rank: int, world: int, root: str, base: str, kind: str, opt_name: str, last: int, kill_at: int | None,
        max_steps: int | str = 64, split_nodes: bool | list[str] = True, every: int | None = EVERY,
        auto_share: list[int] | None = None) -> dict[str, Any]:
    """Restore (full checkpoint + the per-step log), train to ``last``; ``kill_at``: rank 1 dies by SIGKILL right
    after ``maybe_save`` of that step; ``every``: full checkpoints every that many steps (None: no interval save,
    only the last step's); ``split_nodes``: each rank its own node, or one node, or the node of each rank;
    ``auto_share``: per rank, the share of the shared memory a ``max_steps="auto"`` ring may take (1/that: a rank
    whose node had less room). Returns {"start", "losses" {step: loss}, "state", "recovery", "held", "ring"}."""
    if auto_share is not None:
        from liferaft.tiers import steplog, stepplan

        steplog.AUTO_SHARE = stepplan.AUTO_SHARE = auto_share[rank]
    st = build(kind, opt_name, world)
    node = split_nodes[rank] if isinstance(split_nodes, list) else f"node{rank}" if split_nodes else "node0"
    tier = MemoryTier("steplog-test", node=node, base=base, timeout=30)
    policy = liferaft.SavePolicy(every_steps=every, last_step=last)
    mgr = CheckpointManager(root, save_policy=policy, tiers=TierOptions(memory=tier, memory_every=10 ** 6,
                                                                       drain=False),
                            step_log=StepLogOptions(replicas=1, max_steps=max_steps),
                            job=JobOptions(job_id="steplog-test", lease_ttl=5.0),
                            save_options=liferaft.SaveOptions(timeout=30))
    start = mgr.restore(st)
    losses = {}
    for step in range(0 if start is None else start + 1, last + 1):
        losses[step] = train_step(st, rank, step)
        mgr.maybe_save(step, st)
        if step == kill_at and rank == 1:
            mgr.wait()                      # the full checkpoint before it is durable: the test knows K
            os.kill(os.getpid(), signal.SIGKILL)
    log = mgr._steplog
    assert log is not None
    out = {"start": start, "losses": losses, "state": snapshot(st), "recovery": dict(log.last_recovery),
           "held": log.held_steps(), "durable": log.durable, "diverged": len(log._sender.diverged),
           "unsent": log._sender.saved_bytes, "ring": log.max_steps}
    mgr.close()
    return out


def replay_alone(rank: int, world: int, opt_name: str) -> bool:
    """FSDP2: one step together, then rank 0 alone replays a step through ``state.optsteps.replay_call`` while
    rank 1 has returned: a replay that made any collective would fail or hang here."""
    import torch.distributed as dist

    from liferaft.state import optsteps

    st = build("fsdp", opt_name, world)
    train_step(st, rank, 0)
    dist.barrier()
    if rank != 0:
        return True
    opt = st["optim"]
    grads = [torch.ones_like(optsteps.local_of(p)) for p in optsteps.params_of(opt)]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = [optsteps.local_of(p).clone() for p in optsteps.params_of(opt)]
    optsteps.replay_call(opt, grads, groups, {})
    return any(not torch.equal(b, optsteps.local_of(p)) for b, p in zip(before, optsteps.params_of(opt), strict=True))
