"""Train a small GPT-style model with liferaft checkpoints — the script to copy. Run under torchrun:

    torchrun --nproc-per-node 2 examples/train_gpt.py --root ckpt/run1 --steps 200 --layout fsdp
    torchrun --nproc-per-node 3 examples/train_gpt.py --root ckpt/run1 --steps 400 --layout fsdp   # resumes
    torchrun --nproc-per-node 2 examples/train_gpt.py --root s3://bucket/run1 --layout ddp            # on S3

It resumes from the newest committed checkpoint under ``--root`` (any layout, any number of ranks), saves every
``--every`` steps asynchronously, keeps the last ``--keep-last``, stops cleanly on SIGTERM/SIGUSR1 after saving,
and keeps the data order (``GlobalSampler``) and random streams (``RNGState``) in the checkpoint. CPU + gloo by
default; ``--device cuda`` uses NCCL and one GPU per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn

import liferaft
from liferaft import SavePolicy
from liferaft.data import GlobalSampler

VOCAB, DIM, LAYERS, SEQ = 512, 128, 4, 32
SOURCES, WEIGHTS = {"web": 4096, "code": 1024}, {"web": 0.8, "code": 0.2}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tokens(source: str, index: int) -> torch.Tensor:
    """The dataset: sample ``index`` of ``source`` (synthetic, a pure function of both, and learnable: "web"
    counts up by 1 or 2 from a random token, "code" counts down by 1, wrapping around the vocabulary)."""
    g = torch.Generator().manual_seed((1 + list(SOURCES).index(source)) * 1_000_003 + index)
    start = int(torch.randint(0, VOCAB, (1,), generator=g))
    stride = int(torch.randint(1, 3, (1,), generator=g)) if source == "web" else -1
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def shard(model: GPT, layout: str, world: int, device: str) -> nn.Module:
    """``fsdp``: FSDP2 over all ranks (each block, then the root); ``ddp``: replicated with DDP."""
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model.to(device))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(rank: int, world: int, layout: str = "fsdp", device: str = "cpu", batch: int = 12) -> dict[str, Any]:
    """The whole training state: model, optimizer, data position, random streams, step."""
    model = shard(GPT(), layout, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = GlobalSampler(SOURCES, weights=WEIGHTS, global_batch_size=batch, seed=1, rank=rank, world=world)
    return {"model": model, "optim": opt, "data": data, "rng": liferaft.RNGState(), "step": 0}


def train_step(state: dict[str, Any], batches: Any, device: str = "cpu") -> torch.Tensor:
    ids = torch.stack([tokens(s.source, s.index) for s in next(batches)]).to(device)
    logits = state["model"](ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] += 1
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint root: a local folder or s3://bucket/prefix")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--layout", choices=["fsdp", "ddp"], default="fsdp")
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--batch", type=int, default=12, help="global batch size (samples)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sync", action="store_true", help="save synchronously instead of in the background")
    args = ap.parse_args(argv)
    torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    state = build(rank, world, args.layout, args.device, args.batch)
    mgr = liferaft.CheckpointManager(args.root, every_steps=args.every, keep_last=args.keep_last,
                                     async_save=not args.sync, save_policy=SavePolicy(last_step=args.steps - 1))
    start = mgr.restore(state)
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if start is not None else 'starting'} on {world} rank(s), "
              f"layout {args.layout}", flush=True)
    batches = state["data"].batches()
    for step in range(state["step"], args.steps):
        loss = train_step(state, batches, args.device)
        mgr.maybe_save(step, state, metrics={"loss": float(loss)})
        if rank == 0 and step % 10 == 0:
            print(f"step {step:5d}  loss {float(loss):.4f}", flush=True)
        if mgr.preempted:
            if rank == 0:
                print(f"preempted: step {step} saved, stopping", flush=True)
            break
    mgr.close()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
