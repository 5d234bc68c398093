"""GPU check of liferaft's CUDA paths (run by gpu_check.sh): exits non-zero on any mismatch.

1. Async save from GPU tensors (pinned buffer pool, side-stream copies, events): ``liferaft.async_save`` with
   blocking and overlapped staging; the tensors are changed on the GPU right after the snapshot is taken, so a copy
   that races the change shows; the saved checkpoint must equal the snapshot bitwise (fp32, bf16, fp16, int64, a
   non-contiguous view). Prints the D2H bandwidth the snapshot achieved vs the copy engine's limit, measured here
   with one large pinned ``non_blocking`` copy on a side stream.
2. The per-step mode on the GPU: a 1-rank job (gloo) trains an MLP, is killed with SIGKILL after step ``KILL_AT``
   (a real process), restarts and resumes; its final parameters and optimizer state must equal an uninterrupted
   run's bitwise (deterministic algorithms on). Four variants: ``plain`` (AdamW, fp32) and ``amp`` (fp16 autocast, a
   GradScaler whose scale and found_inf live on the device, fused AdamW, two micro-batches accumulated per step,
   and an overflowing step every few steps that the scaler skips), and ``fsdp`` (FSDP2 ``fully_shard`` over NCCL, a
   world of one: DTensor parameters, gradients and optimizer state), and ``inplace`` (the ways a record can race
   the training stream: a BatchNorm whose running statistics — CUDA tensors in the rest of the state — are recorded
   after every step, an optimizer that scales its gradients in place inside ``step()``, and
   ``zero_grad(set_to_none=False)``, which zeroes them in place right after it: a record whose side-stream copy
   read a gradient after either change would replay other steps).

3. ``--overhead`` (a measurement, not a check): the per-step mode's cost on a real loop, ``examples/train_gpt.py``
   on one rank (DDP; a 42 M-parameter GPT at 8,192 tokens per step on a GPU): mean step time after a warm-up
   without checkpoints and with ``--per-step``, interleaved reps, and their ratio.

Without a GPU it says so, runs both checks on the CPU (the CUDA paths skipped) and exits 0 — or 3 with
``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.distributed.tensor import DTensor

import liferaft

STEPS, KILL_AT, EVERY = 12, 8, 5


def state_on(device: str, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mib * 2**20 // 4 // 4
    base = torch.randn(n, generator=g)
    wide = torch.randn(64, 96, generator=g)
    return {"fp32": base.to(device), "bf16": base.to(torch.bfloat16).to(device),
            "fp16": base[: n // 2].to(torch.float16).to(device), "int64": torch.arange(n // 4).to(device),
            "view": wide.to(device).t(),          # non-contiguous
            "host": torch.randn(4096, generator=g)}   # a host tensor beside the device ones (stays on the CPU)


def check_async(device: str, mib: int, tmp: str) -> list[str]:
    bad = []
    for staging in ("blocking", "overlapped"):
        state = state_on(device, mib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        for rep in range(2):                        # the second save reuses the warm pinned pool
            want = {k: t.detach().cpu().clone() for k, t in state.items()}
            path = os.path.join(tmp, f"async-{staging}-{rep}")
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = liferaft.async_save(path, state, options=liferaft.SaveOptions(staging=staging))
            if staging == "overlapped":
                handle.wait_staged()
            staged = time.perf_counter() - t0
            for t in state.values():                # change every tensor on the device right after the snapshot
                t.add_(1)
            handle.wait()
            got = {k: torch.empty_like(v) for k, v in want.items()}
            liferaft.load(path, got)
            for k in want:
                if not torch.equal(bits(got[k]), bits(want[k])):
                    bad.append(f"async_save ({staging}, rep {rep}) from {device}: {k!r} differs from the snapshot")
            print(f"async_save {staging:10s} rep {rep}: {nbytes / 2**20:.0f} MiB staged in {staged * 1e3:.1f} ms "
                  f"= {nbytes / staged / 1e9:.2f} GB/s (from {device})", flush=True)
    return bad


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def d2h_limit(mib: int) -> float:
    """GB/s of one large pinned non_blocking device-to-host copy on a side stream (median of 5)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times[1:]) / 1e9


def train(device: str, root: str, steps: int, kill_at: int | None, out: str | None, variant: str = "plain") -> None:
    """One incarnation of the 1-rank per-step job (a child process)."""
    torch.use_deterministic_algorithms(True)
    fsdp = variant == "fsdp"
    backend = "nccl" if fsdp and device == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=f"file://{root}/pg", rank=0, world_size=1)
    torch.manual_seed(0)
    inplace = variant == "inplace"
    norm = [torch.nn.BatchNorm1d(512)] if inplace else []
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), *norm, torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[-1]):
            fully_shard(layer)
        fully_shard(model)
    amp = variant == "amp"
    opt = (HalvingSGD(model.parameters(), lr=1e-2, momentum=0.9) if inplace else
           torch.optim.AdamW(model.parameters(), lr=1e-3, fused=amp))
    state = {"model": model, "optim": opt, "rng": liferaft.RNGState(), "step": 0}
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3) if amp else None
    if scaler is not None:
        state["scaler"] = scaler
    mgr = liferaft.CheckpointManager(
        os.path.join(root, "ckpt"), every_steps=EVERY, job=liferaft.JobOptions(job_id="gpu-check"),
        tiers=liferaft.TierOptions(memory=liferaft.MemoryTier("gpu-check", base=os.path.join(root, "shm"),
                                                              replicas=0), memory_every=EVERY),
        step_log=liferaft.StepLogOptions(replicas=0))
    start = mgr.restore(state)
    print(f"  {'resumed from step ' + str(start) if start is not None else 'started'}", flush=True)
    for step in range(state["step"], steps):
        if scaler is None:
            x = torch.randn(32, 256, device=device)       # from the restored random streams
            loss = (model(x) - x).square().mean()
            loss.backward()
            opt.step()
        else:
            for _ in range(2):                            # two micro-batches accumulated
                x = torch.randn(16, 256, device=device)
                with torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16):
                    loss = (model(x) - x).square().mean() / 2
                if step % 4 == 2:
                    loss = loss * float("inf")            # overflow: the scaler skips this step
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=not inplace)
        state["step"] += 1
        mgr.maybe_save(step, state)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    flat = {f"model.{k}": whole(v) for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        flat.update({f"optim.{i}.{k}": whole(v) for k, v in s.items() if torch.is_tensor(v)})
    if scaler is not None:                            # the scale after the skipped and grown steps
        flat["scaler.scale"] = torch.tensor(scaler.get_scale(), dtype=torch.float64)
    torch.save(flat, out)
    torch.distributed.destroy_process_group()


class HalvingSGD(torch.optim.SGD):
    """SGD that halves its gradients in place before stepping (as optimizers that transform gradients in place
    do, e.g. Muon's momentum blend): the per-step hook records them before the change."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, gathered whole when it is a DTensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def check_per_step(device: str, tmp: str, variant: str) -> list[str]:
    if not hasattr(liferaft, "StepLogOptions"):
        print("per-step: SKIPPED (this liferaft has no StepLogOptions)", flush=True)
        return []
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def child(root: str, kill_at: int | None, out: str | None) -> int:
        os.makedirs(root, exist_ok=True)
        cmd = [sys.executable, __file__, "--child", root, "--device", device,
               "--kill-at", str(-1 if kill_at is None else kill_at), "--out", out or "", "--variant", variant]
        return subprocess.run(cmd, env=env, timeout=600).returncode

    tmp = os.path.join(tmp, variant)
    straight, killed = os.path.join(tmp, "whole"), os.path.join(tmp, "killed")
    bad = []
    if child(straight, None, os.path.join(tmp, "whole.pt")) != 0:
        return [f"per-step ({variant}): the uninterrupted run failed"]
    rc = child(killed, KILL_AT, None)
    if rc != -signal.SIGKILL:
        bad.append(f"per-step ({variant}): the run to be killed ended with {rc}, not SIGKILL")
    if child(killed, None, os.path.join(tmp, "resumed.pt")) != 0:
        return [*bad, f"per-step ({variant}): the resumed run failed"]
    a, b = torch.load(os.path.join(tmp, "whole.pt")), torch.load(os.path.join(tmp, "resumed.pt"))
    if a.keys() != b.keys():
        bad.append(f"per-step ({variant}): resumed state has keys {sorted(b)} != {sorted(a)}")
    bad += [f"per-step ({variant}) on {device}: {k} differs from the uninterrupted run" for k in a if k in b
            and not torch.equal(a[k], b[k])]
    print(f"per-step ({variant}) on {device}: killed after step {KILL_AT}, resumed; {len(a)} tensors compared bitwise", flush=True)
    return bad


def step_overhead(device: str, warmup: int, steps: int, reps: int) -> None:
    """Print the mean step time of train_gpt.py on one rank without checkpoints and with the per-step mode."""
    from liferaft.testing.launcher import free_port
    from liferaft.tiers.memory import DEFAULT_BASE

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_gpt.py")
    model = (["--dim", "768", "--layers", "6", "--seq", "256", "--batch", "32"] if device == "cuda" else
             ["--dim", "128", "--layers", "2", "--seq", "32", "--batch", "12"])
    means: dict[str, list[float]] = {"none": [], "per-step": []}
    saves: list[float] = []             # per-step mode: the mean wall time inside maybe_save (the training thread's)
    with tempfile.TemporaryDirectory(prefix="gpu-steps-") as tmp:
        for rep in range(reps):
            for mode in ("none", "per-step") if rep % 2 == 0 else ("per-step", "none"):
                root, job = os.path.join(tmp, f"{mode}-{rep}"), f"gpu-steps-{os.getpid()}-{rep}-{mode}"
                timing = root + ".jsonl"
                env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
                flags = ["--no-ckpt"] if mode == "none" else ["--per-step", "--every", "auto", "--mtbf-hours", "1"]
                try:
                    subprocess.run([sys.executable, script, "--root", root, "--device", device, "--layout", "ddp",
                                    "--steps", str(warmup + steps), "--job-id", job, "--timing", timing, *model,
                                    *flags], env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
                finally:
                    shutil.rmtree(os.path.join(DEFAULT_BASE, job), ignore_errors=True)   # the memory tier's
                with open(timing) as f:
                    rows = [json.loads(line) for line in f if '"step"' in line]
                means[mode].append(statistics.fmean(r["s"] for r in rows if r["step"] >= warmup))
                inside = statistics.fmean(r.get("save_s", 0.0) for r in rows if r["step"] >= warmup)
                if mode == "per-step":
                    saves.append(inside)
                print(f"  {mode:8s} rep {rep}: mean step {means[mode][-1] * 1e3:.1f} ms, of it in maybe_save "
                      f"{inside * 1e3:.2f} ms", flush=True)
    none, per = statistics.median(means["none"]), statistics.median(means["per-step"])
    print(f"per-step overhead on {device} (train_gpt.py {' '.join(model)}, DDP, 1 rank, steps {warmup}.."
          f"{warmup + steps - 1}, {reps} reps): {none * 1e3:.1f} ms -> {per * 1e3:.1f} ms per step "
          f"({(per / none - 1) * 100:+.1f} %; inside maybe_save {statistics.median(saves) * 1e3:.2f} ms per step)",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size of the async check (MiB)")
    ap.add_argument("--require-gpu", action="store_true", help="exit 3 when no GPU is present")
    ap.add_argument("--overhead", action="store_true", help="also measure the per-step mode's step-time overhead")
    ap.add_argument("--overhead-warmup", type=int, default=100, help="untimed steps of each overhead run")
    ap.add_argument("--overhead-steps", type=int, default=100, help="timed steps of each overhead run")
    ap.add_argument("--overhead-reps", type=int, default=2, help="interleaved reps of the overhead runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(args.device, args.child, STEPS, None if args.kill_at < 0 else args.kill_at, args.out, args.variant)
        return 0
    gpu = torch.cuda.is_available()
    if not gpu:
        then = ("--require-gpu: exiting with status 3, nothing checked." if args.require_gpu
                else "Running the same checks on the CPU.")
        print(f"NO GPU PRESENT: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device; "
              f"the CUDA paths are NOT checked. {then}", file=sys.stderr if args.require_gpu else sys.stdout,
              flush=True)
        if args.require_gpu:
            return 3
    device = "cuda" if gpu else "cpu"
    bad = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        bad += check_async(device, args.mib if gpu else min(args.mib, 64), tmp)
        if gpu:
            print(f"{torch.cuda.get_device_name()}: D2H copy-engine limit (pinned, non_blocking, side stream) "
                  f"{d2h_limit(args.mib):.2f} GB/s", flush=True)
        for variant in ("plain", "amp", "fsdp", "inplace"):
            bad += check_per_step(device, tmp, variant)
    if args.overhead:
        step_overhead(device, args.overhead_warmup, args.overhead_steps, args.overhead_reps)
    for line in bad:
        print("MISMATCH:", line, flush=True)
    print("FAILED" if bad else f"OK ({'GPU' if gpu else 'CPU only, no GPU'})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
