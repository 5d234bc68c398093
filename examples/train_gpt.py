"""Train a small GPT-style model with liferaft checkpoints — the script to copy. Run under torchrun:

    torchrun --nproc-per-node 2 examples/train_gpt.py --root ckpt/run1 --steps 200 --layout fsdp
    torchrun --nproc-per-node 3 examples/train_gpt.py --root ckpt/run1 --steps 400 --layout fsdp   # resumes
    torchrun --nproc-per-node 2 examples/train_gpt.py --root s3://bucket/run1 --layout ddp            # on S3

It resumes from the newest committed checkpoint under ``--root`` (any layout, any number of ranks), saves every
``--every`` steps asynchronously, keeps the last ``--keep-last``, stops cleanly on SIGTERM/SIGUSR1 after saving,
and keeps the data order (``GlobalSampler``) and random streams (``RNGState``) in the checkpoint. CPU + gloo by
default; ``--device cuda`` uses NCCL and one GPU per rank.

``--per-step`` makes every optimizer step recoverable (a per-step gradient log in node memory with a peer replica,
docs/STEPLOG.md); ``--every auto`` saves at the Young/Daly interval for ``--mtbf-hours``. For comparison:
``--dcp-async N|auto`` (PyTorch DCP ``async_save`` instead), ``--no-ckpt``. ``--timing F`` appends one JSON line
per step (rank 0: wall and process CPU seconds, all threads, and the wall seconds inside ``maybe_save``);
benchmarks/bench_steps.py drives all of these.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from typing import Any

STARTED = time.time()          # (for --timing: when this process started, before the heavy imports)

import torch
from torch import nn

import liferaft
from liferaft import SavePolicy
from liferaft.data import GlobalSampler

VOCAB, DIM, LAYERS, SEQ = 512, 128, 4, 32
SOURCES, WEIGHTS = {"web": 4096, "code": 1024}, {"web": 0.8, "code": 0.2}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dim: int = DIM, layers: int = LAYERS, seq: int = SEQ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tokens(source: str, index: int, seq: int = SEQ) -> torch.Tensor:
    """The dataset: sample ``index`` of ``source`` (synthetic, a pure function of both, and learnable: "web"
    counts up by 1 or 2 from a random token, "code" counts down by 1, wrapping around the vocabulary)."""
    g = torch.Generator().manual_seed((1 + list(SOURCES).index(source)) * 1_000_003 + index)
    start = int(torch.randint(0, VOCAB, (1,), generator=g))
    stride = int(torch.randint(1, 3, (1,), generator=g)) if source == "web" else -1
    return (start + stride * torch.arange(seq + 1)) % VOCAB


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


def build(rank: int, world: int, layout: str = "fsdp", device: str = "cpu", batch: int = 12, dim: int = DIM,
          layers: int = LAYERS, seq: int = SEQ) -> dict[str, Any]:
    """The whole training state: model, optimizer, data position, random streams, step."""
    model = shard(GPT(dim, layers, seq), layout, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = GlobalSampler(SOURCES, weights=WEIGHTS, global_batch_size=batch, seed=1, rank=rank, world=world)
    return {"model": model, "optim": opt, "data": data, "rng": liferaft.RNGState(), "step": 0}


def train_step(state: dict[str, Any], batches: Any, device: str = "cpu", seq: int = SEQ) -> torch.Tensor:
    ids = torch.stack([tokens(s.source, s.index, seq) for s in next(batches)]).to(device)
    logits = state["model"](ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] += 1
    return loss.detach()


class DCPCheckpoints:
    """The comparison mode ``--dcp-async``: PyTorch DCP ``async_save`` of the same model, optimizer, data position
    and step under ``<root>/dcp/step-N`` every ``every`` steps, or at the Young/Daly interval sqrt(2 x save cost x
    MTBF) (``every="auto"``: the cost is the stall of the last save, measured). Resumes from the newest complete one
    (DCP writes ``.metadata`` last)."""

    def __init__(self, root: str, every: str, mtbf_s: float) -> None:
        self.root, self.every, self.mtbf_s = os.path.join(root, "dcp"), every, mtbf_s
        self.future: Any = None
        self.next_step: int | None = None if every == "auto" else 0
        self.step_s, self.last = 0.0, time.perf_counter()
        self.group = torch.distributed.new_group(backend="gloo")   # the background save's collectives, apart

    def _dicts(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(state["model"], state["optim"])
        return {"model": model, "optim": optim, "step": state["step"], "data": state["data"].state_dict()}

    def restore(self, state: dict[str, Any]) -> int | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        done = [int(n[5:]) for n in (os.listdir(self.root) if os.path.isdir(self.root) else [])
                if n.startswith("step-") and n[5:].isdigit() and os.path.exists(os.path.join(self.root, n,
                                                                                                ".metadata"))]
        if not done:
            return None
        sd = self._dicts(state)
        dcp.load(sd, checkpoint_id=os.path.join(self.root, f"step-{max(done)}"))
        set_state_dict(state["model"], state["optim"], model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        state["data"].load_state_dict(sd["data"])
        state["step"] = sd["step"]
        return max(done)

    def maybe_save(self, step: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        now = time.perf_counter()
        if self.next_step is None:             # the first call: the step time is not known yet, save now
            self.next_step = step
        if step < self.next_step:
            self.step_s = 0.9 * self.step_s + 0.1 * (now - self.last) if self.step_s else now - self.last
            self.last = now
            return
        if self.future is not None:
            self.future.result()                # the previous save is durable before the next starts
        self.future = dcp.async_save(self._dicts(state), checkpoint_id=os.path.join(self.root, f"step-{step}"),
                                     process_group=self.group)
        cost = time.perf_counter() - now
        every = int(self.every) if self.every != "auto" else \
            max(1, round(math.sqrt(2 * cost * self.mtbf_s) / max(self.step_s, 1e-3)))
        agreed = torch.tensor([every])          # rank 0's interval for every rank (one message per save)
        torch.distributed.broadcast(agreed, 0)
        self.next_step, self.last = step + int(agreed), time.perf_counter()

    def close(self) -> None:
        if self.future is not None:
            self.future.result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint root: a local folder or s3://bucket/prefix")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--layout", choices=["fsdp", "ddp"], default="fsdp")
    ap.add_argument("--every", default="20", help="save every N steps, or 'auto' (Young/Daly, --mtbf-hours)")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--batch", type=int, default=12, help="global batch size (samples)")
    ap.add_argument("--dim", type=int, default=DIM, help="model width")
    ap.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sample (the context length)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sync", action="store_true", help="save synchronously instead of in the background")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--per-step", action="store_true", help="make every step recoverable: a per-step gradient "
                      "log in a memory tier (node: torchrun's GROUP_RANK) with a peer replica, full saves at --every")
    mode.add_argument("--memory", action="store_true", help="full saves at --every to a memory tier (node: "
                      "torchrun's GROUP_RANK) with a peer replica, drained to the root")
    mode.add_argument("--dcp-async", metavar="N|auto", help="compare: PyTorch DCP async_save instead of liferaft")
    mode.add_argument("--no-ckpt", action="store_true", help="compare: no checkpoints at all")
    ap.add_argument("--mtbf-hours", type=float, default=24.0, help="mean time between failures for 'auto'")
    ap.add_argument("--job-id", help="the job across restarts (default: derived by the manager)")
    ap.add_argument("--timing", metavar="FILE", help="rank 0 appends one JSON line per step (wall seconds)")
    args = ap.parse_args(argv)
    marks = {"started": STARTED, "imported": time.time()}
    # (liferaft's: torch's own, but safe across torchrun's elastic restarts: docs/ELASTIC.md)
    liferaft.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    marks["process_group"] = time.time()
    state = build(rank, world, args.layout, args.device, args.batch, args.dim, args.layers, args.seq)
    marks["built"] = time.time()
    policy = SavePolicy(last_step=args.steps - 1, mtbf_hours=args.mtbf_hours,
                        **({"every_seconds": "auto"} if args.every == "auto" else {"every_steps": int(args.every)}))
    if args.no_ckpt:
        mgr = None
    elif args.dcp_async:
        mgr = DCPCheckpoints(args.root, args.dcp_async, args.mtbf_hours * 3600)
    else:
        extra: dict[str, Any] = {}
        if args.per_step or args.memory:
            # the memory tier's namespace: the job id, else one per root (a restart finds its records)
            job = args.job_id or "train-gpt-" + hashlib.sha256(args.root.encode()).hexdigest()[:12]
            every = "auto" if args.every == "auto" else int(args.every)
            extra = {"tiers": liferaft.TierOptions(memory=liferaft.MemoryTier(job), memory_every=every)}
            if args.per_step:
                extra["step_log"] = liferaft.StepLogOptions(replicas=1)
        mgr = liferaft.CheckpointManager(args.root, keep_last=args.keep_last, async_save=not args.sync,
                                         save_policy=policy, job=liferaft.JobOptions(job_id=args.job_id), **extra)
    t0 = marks["manager"] = time.time()
    start = mgr.restore(state) if mgr is not None else None
    marks["restored"] = time.time()
    timing = open(args.timing, "a") if args.timing and rank == 0 else None
    if timing:
        recovery = getattr(getattr(mgr, "_steplog", None), "last_recovery", None) or {}
        timing.write(json.dumps({"resumed": start, "restore_s": time.time() - t0, "t": time.time(), "marks": marks,
                                 "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                 "recovery": recovery.get("timings"), "replayed": recovery.get("replayed")})
                     + "\n")
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if start is not None else 'starting'} on {world} rank(s), "
              f"layout {args.layout}", flush=True)
    batches = state["data"].batches()
    for step in range(state["step"], args.steps):
        t, cpu = time.perf_counter(), time.process_time()
        loss = train_step(state, batches, args.device, args.seq)
        value = float(loss)
        saving = time.perf_counter()
        if isinstance(mgr, liferaft.CheckpointManager):
            mgr.maybe_save(step, state, metrics={"loss": value})
        elif mgr is not None:
            mgr.maybe_save(step, state)
        if timing:
            now = time.perf_counter()
            timing.write(json.dumps({"step": step, "s": now - t, "cpu": time.process_time() - cpu,
                                     "save_s": now - saving, "t": time.time()}) + "\n")
            timing.flush()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:5d}  loss {value:.4f}", flush=True)
        if isinstance(mgr, liferaft.CheckpointManager) and mgr.preempted:
            if rank == 0:
                print(f"preempted: step {step} saved, stopping", flush=True)
            break
    if mgr is not None:
        mgr.close()
    # every rank past its last collective before any tears its connections down: a rank that exits first closes
    # sockets a peer's gloo thread may still read, and that peer aborts ("terminate called without an active
    # exception"; seen 2 in 8 runs of the --quick bench at --no-ckpt)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
