"""The main job (``make demo``): an FSDP2-sharded GPT-style model trained on 2 ranks is checkpointed with
liferaft, then loaded into 1 process (plain model) and into 3 ranks (FSDP2 over 3), and checked bit-exact.

Ranks are real processes talking gloo over 127.0.0.1. Prints what each step did and how long each phase took.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from torch import nn

import liferaft
from liferaft.testing import run_ranks

VOCAB, DIM, LAYERS, SEQ = 512, 128, 4, 32
# FSDP2 warns that the root returns a view (the LM head's output); nothing here modifies it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


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


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def fsdp(model: GPT, world: int) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full parameters and Adam moments by name (gathered only here, for the check)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    out = {f"p:{k}": full(v).clone() for k, v in get_model_state_dict(model, options=o).items()}
    for k, st in get_optimizer_state_dict(model, opt, options=o)["state"].items():
        out.update({f"o:{k}.{n}": full(t).clone() for n, t in st.items()})
    return out


def train_and_save(rank: int, world: int, path: str, ref_path: str) -> dict[str, Any]:
    model = fsdp(GPT(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    fp = fingerprint(model, opt)
    if rank == 0:
        torch.save(fp, ref_path)
    res = liferaft.save(path, {"model": model, "optim": opt, "step": 6, "losses": losses})
    return {"losses": losses, "bytes": res.bytes_written, "timings": dict(res.timings)}


def restore(model: nn.Module, path: str, ref_path: str) -> tuple[Any, dict[str, Any], torch.optim.Optimizer, list[str]]:
    """Load the checkpoint into ``model`` + a fresh AdamW (wrong lr on purpose); list what differs from the
    reference fingerprint."""
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    state = {"model": model, "optim": opt, "step": 0, "losses": []}
    res = liferaft.load(path, state)
    ref, fp = torch.load(ref_path), fingerprint(model, opt)
    return res, state, opt, [k for k in ref if not torch.equal(ref[k], fp[k])]


def load_sharded(rank: int, world: int, path: str, ref_path: str) -> dict[str, Any]:
    model = fsdp(GPT(), world)
    res, state, _, bad = restore(model, path, ref_path)
    loss = loss_of(model, batch(state["step"])).item()
    return {"bad": bad, "bytes": res.bytes_read, "timings": dict(res.timings), "step": state["step"], "loss": loss}


def show(title: str, rows: list[dict[str, Any]], key: str) -> None:
    phases = list(rows[0]["timings"])
    print(f"  {title}")
    for r, row in enumerate(rows):
        t = " ".join(f"{p}={row['timings'][p] * 1000:7.1f}ms" for p in phases)
        print(f"    rank {r}: {row[key] / 2**20:6.2f} MiB  {t}")


def main() -> int:
    root = tempfile.mkdtemp(prefix="liferaft-demo-")
    path, ref_path = os.path.join(root, "ckpt"), os.path.join(root, "reference.pt")
    try:
        print("1. Train a GPT-style model (FSDP2, 2 ranks, AdamW) for 6 steps, then liferaft.save ...")
        t0 = time.perf_counter()
        saved = run_ranks(train_and_save, 2, path, ref_path)
        print(f"   losses: {saved[0]['losses']}  ({time.perf_counter() - t0:.1f}s incl. process start)")
        show("save (each rank writes only its own shards):", saved, "bytes")
        info = liferaft.inspect(path)
        print(f"   checkpoint: {len(info.tensors)} tensors, {info.total_bytes / 2**20:.2f} MiB in "
              f"{len(info.files)} files, written by {info.world_size} ranks")
        t0 = time.perf_counter()
        rep = liferaft.verify(path)
        print(f"   verify: {rep.chunks} chunks, {rep.bytes_checked / 2**20:.2f} MiB re-hashed OK "
              f"({(time.perf_counter() - t0) * 1000:.0f}ms)")

        print("2. Load into ONE process, plain (unsharded) model + AdamW, no process group ...")
        model = GPT()
        res, state, opt, bad = restore(model, path, ref_path)
        print(f"   {res.bytes_read / 2**20:.2f} MiB read; " + " ".join(f"{p}={v * 1000:.1f}ms" for p, v in res.timings.items()))
        print(f"   params + optimizer state bit-exact: {not bad}; step={state['step']}; "
              f"lr restored={opt.param_groups[0]['lr']}; next loss={loss_of(model, batch(6)).item():.4f}")

        print("3. Load into THREE ranks (FSDP2 over 3: every shard boundary moves) ...")
        loaded = run_ranks(load_sharded, 3, path, ref_path)
        show("load (each rank reads only the byte ranges of its new shards):", loaded, "bytes")
        bad3 = [b for row in loaded for b in row["bad"]]
        print(f"   params + optimizer state bit-exact on all ranks: {not bad3}; "
              f"next loss on 3 ranks={loaded[0]['loss']:.4f}")
        ok = not bad and not bad3
        print("demo: OK" if ok else f"demo: MISMATCH {bad[:5]} {bad3[:5]}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
