"""The main job (``make demo``): a training run that checkpoints, crashes, and resumes on another layout.

1. A GPT-style model is trained with FSDP2 on 2 ranks; a ``CheckpointManager`` saves asynchronously every 5 steps
   (data position in ``GlobalSampler``, random streams in ``RNGState``).
2. At step 23 one rank is killed (``kill -9``): the job dies.
3. A new job on 3 ranks restores the newest committed checkpoint (resharding every tensor), checks it bit for
   bit against what was saved, and trains on to step 40 in the same global data order.
4. It prints the loss curve across the crash (and saves it as PNG), the steps that were redone, and the save
   stall and load time of liferaft next to PyTorch DCP on the same state.

Ranks are real processes talking gloo over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import liferaft
from liferaft import JobOptions
from liferaft.testing import RankFailure, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                           # the rank processes find it through PYTHONPATH (main())
from train_gpt import build, train_step

STEPS, EVERY, CRASH_AT = 40, 5, 23
# FSDP2 warns that the root returns a view (the LM head's output); nothing here modifies it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
# 2 → 3 ranks: RNGState gives each new rank derived streams and warns; the demo says so once itself
warnings.filterwarnings("ignore", message="liferaft.RNGState: saved by")


def fingerprint(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full parameters and AdamW moments by name (gathered only here, for the check)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model, opt = state["model"], state["optim"]
    o = StateDictOptions(full_state_dict=True)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    out = {f"p:{k}": full(v).clone() for k, v in get_model_state_dict(model, options=o).items()}
    for k, st in get_optimizer_state_dict(model, opt, options=o)["state"].items():
        out.update({f"o:{k}.{n}": full(t).clone() for n, t in st.items()})
    return out


def train(rank: int, state: dict[str, Any], mgr: liferaft.CheckpointManager, log: str, fp_dir: str,
          crash_at: int | None) -> dict[str, float]:
    """Train from ``state["step"]`` to STEPS; rank 0 logs each loss; the saves' stalls are timed."""
    world = torch.distributed.get_world_size()
    batches = state["data"].batches()
    stalls = []
    for step in range(state["step"], STEPS):
        loss = train_step(state, batches)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "world": world, "loss": float(mean) / world}) + "\n")
        t0 = time.perf_counter()
        if mgr.maybe_save(step, state):
            stalls.append(time.perf_counter() - t0)
            mgr.wait()                                  # (only so that the fingerprint below matches the save)
            fp = fingerprint(state)
            if rank == 0:
                torch.save(fp, os.path.join(fp_dir, f"{step}.pt"))
        if crash_at is not None and step == crash_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)        # the crash: rank 1 dies mid-run
    mgr.close()
    return {"stall_s": sum(stalls) / max(1, len(stalls))}


def job(rank: int, world: int, root: str, log: str, fp_dir: str, crash_at: int | None) -> dict[str, Any]:
    state = build(rank, world)
    mgr = liferaft.CheckpointManager(root, every_steps=EVERY, keep_last=3, job=JobOptions(job_id="demo"))
    t0 = time.perf_counter()
    restored = mgr.restore(state)
    load_s = time.perf_counter() - t0
    exact = None
    if restored is not None:
        ref = torch.load(os.path.join(fp_dir, f"{restored}.pt"))
        fp = fingerprint(state)
        exact = all(torch.equal(ref[k], fp[k]) for k in ref) and ref.keys() == fp.keys()
    out = train(rank, state, mgr, log, fp_dir, crash_at)
    return {"restored": restored, "exact": exact, "load_s": load_s, **out}


def versus_dcp(rank: int, world: int, root: str) -> dict[str, float]:
    """Warm async-save stall and load time of liferaft and DCP on the same state (3 ranks), after one training
    step: the state a job saves. (An optimizer that never stepped has no state; torch's state dict then makes
    placeholders with a zero-gradient step at every liferaft save, which liferaft takes away again, and once at
    DCP's first: that is not what a training job pays.)"""
    import torch.distributed.checkpoint as dcp

    state = build(rank, world)
    train_step(state, state["data"].batches())
    sd = {"model": state["model"], "optim": state["optim"]}
    out: dict[str, float] = {}
    for name in ("liferaft", "dcp"):
        for i in range(2):                              # the first save of a process sets up; time the second
            path = os.path.join(root, f"{name}-{i}")
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if name == "liferaft":
                h = liferaft.async_save(path, sd)
                out[f"{name}_stall_s"] = time.perf_counter() - t0
                h.wait()
            else:
                from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

                msd, osd = get_state_dict(state["model"], state["optim"])
                fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path)
                out[f"{name}_stall_s"] = time.perf_counter() - t0
                fut.result()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if name == "liferaft":
            liferaft.load(path, sd)
        else:
            msd, osd = get_state_dict(state["model"], state["optim"])
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            set_state_dict(state["model"], state["optim"], model_state_dict=msd, optim_state_dict=osd)
        out[f"{name}_load_s"] = time.perf_counter() - t0
    return out


def redone_match(points: list[dict[str, Any]], restored: int) -> list[tuple[int, float, float]]:
    """(step, loss before the crash, loss when redone) for every step trained on both sides of the crash."""
    first = {p["step"]: p["loss"] for p in points if p["world"] == 2}
    return [(p["step"], first[p["step"]], p["loss"]) for p in points
            if p["world"] == 3 and p["step"] in first and p["step"] > restored]


def plot(points: list[dict[str, Any]], restored: int, crash_at: int, path: str) -> bool:
    """The loss across the crash (hollow markers for the 3-rank run, so the redone steps show on top of the
    first run's), and below it the difference on the redone steps, which the top panel cannot show."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 5), height_ratios=(3, 1.2), sharex=True)
    before = [p for p in points if p["world"] == 2]
    after = [p for p in points if p["world"] == 3]
    ax.plot([p["step"] for p in before], [p["loss"] for p in before], "o-", ms=4, color="tab:blue",
            label="first run, 2 ranks")
    ax.plot([p["step"] for p in after], [p["loss"] for p in after], "s--", ms=7, mfc="none", color="tab:orange",
            label="resumed run, 3 ranks")
    redone = redone_match(points, restored)
    if redone:
        ax.axvspan(redone[0][0] - 0.5, redone[-1][0] + 0.5, color="tab:orange", alpha=0.12,
                   label=f"steps {redone[0][0]}–{redone[-1][0]} redone")
    for a in (ax, dx):
        a.axvline(crash_at + 0.5, color="red", ls="--")
        a.axvline(restored + 0.5, color="gray", ls=":")
    ax.text(crash_at + 0.7, ax.get_ylim()[1], f"rank 1 killed after step {crash_at}", color="red", va="top", fontsize=8)
    ax.text(restored + 0.3, ax.get_ylim()[1], f"resumed from step {restored}", color="gray", va="top", ha="right",
            fontsize=8)
    ax.set_ylabel("loss")
    ax.legend(loc="lower left", fontsize=8)
    if redone:
        diffs = [b - a for _, a, b in redone]
        dx.bar([s for s, _, _ in redone], diffs, color="tab:orange", width=0.6)
        dx.axhline(0, color="black", lw=0.8)
        worst = max(abs(d) for d in diffs)
        dx.set_ylim(-max(worst, 1e-9) * 3, max(worst, 1e-9) * 3)
        dx.set_title(f"redone − first run, same steps: max |Δ| = {worst:.1e}", fontsize=9)
    dx.set_ylabel("Δ loss")
    dx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    work = tempfile.mkdtemp(prefix="liferaft-demo-")
    root, log, fps = os.path.join(work, "ckpt"), os.path.join(work, "loss.jsonl"), os.path.join(work, "fp")
    os.makedirs(fps)
    out_dir = os.path.join(os.getcwd(), "demo-out")
    os.makedirs(out_dir, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    try:
        print(f"1. Train a GPT-style model (FSDP2, 2 ranks, AdamW, 2 data sources); async checkpoint every {EVERY} "
              f"steps; rank 1 is killed after step {CRASH_AT} ...")
        try:
            run_ranks(job, 2, root, log, fps, CRASH_AT, timeout=600)
            print("   the job did not crash?")
            return 1
        except RankFailure as e:
            print("   the job died as planned:")
            for r, v in sorted(e.errors.items()):
                print(f"     rank {r}: {v.strip().splitlines()[-1]}")
        mgr_view = liferaft.CheckpointManager(root, job=JobOptions(job_id="demo", lease_ttl=1.0))
        print("   steps on disk: " + ", ".join(f"{i.step} ({i.status})" for i in mgr_view.steps()))
        mgr_view.close()

        print("2. A new job on 3 ranks restores the newest committed step (every shard boundary moves) and trains on ...")
        res = run_ranks(job, 3, root, log, fps, None, timeout=600)
        restored = res[0]["restored"]
        print(f"   restored step {restored} in {max(r['load_s'] for r in res):.2f}s; params + AdamW state bit-exact "
              f"with what was saved on every rank: {all(r['exact'] for r in res)}; the data order goes on where it "
              "stopped; the 3 ranks get random streams derived from the 2 saved ones")
        points = [json.loads(line) for line in open(log)]
        redone = [p["step"] for p in points if p["world"] == 2 and p["step"] > restored]
        print(f"   lost work: steps {redone[0]}..{redone[-1]} were trained before the crash and redone after it"
              if redone else "   lost work: none")
        match = redone_match(points, restored)
        if match:
            worst = max(abs(b - a) for _, a, b in match)
            print("   the redone steps, first run vs resumed run: " +
                  ", ".join(f"{s}: {a:.6f} / {b:.6f}" for s, a, b in match) +
                  f" (max |Δ| {worst:.1e}: the same parameters and data; the loss is a mean over 3 ranks instead of 2,"
                  " so only float rounding differs)")
        print("   loss curve (step: loss [ranks], one bar per step):")
        top = max(p["loss"] for p in points)
        for p in points:
            mark = "  <- killed here" if p["world"] == 2 and p["step"] == CRASH_AT else \
                "  <- resumed" if p["world"] == 3 and p["step"] == restored + 1 else \
                "  (redone)" if p["world"] == 3 and p["step"] <= CRASH_AT else ""
            bar = ("#" if p["world"] == 2 else "=") * max(1, round(40 * p["loss"] / top))
            print(f"     {p['step']:3d}: {p['loss']:.4f} [{p['world']}] {bar:<40}{mark}")
        png = os.path.join(out_dir, "loss.png")
        if plot(points, restored, CRASH_AT, png):
            print(f"   plot: {png}")

        print("3. Save stall and load time on the same state (3 ranks, warm), liferaft vs PyTorch DCP ...")
        vs = run_ranks(versus_dcp, 3, os.path.join(work, "vs"), timeout=600)
        worst = {k: max(r[k] for r in vs) for k in vs[0]}
        for what in ("stall", "load"):
            a, b = worst[f"liferaft_{what}_s"], worst[f"dcp_{what}_s"]
            label = "async save stall" if what == "stall" else "load"
            print(f"   {label:<17} liferaft {a * 1000:7.1f} ms   DCP {b * 1000:7.1f} ms   ({b / a:.1f}x)")
        ok = restored == (CRASH_AT // EVERY) * EVERY and all(r["exact"] for r in res) and \
            [p["step"] for p in points if p["world"] == 3] == list(range(restored + 1, STEPS))
        print("demo: OK" if ok else "demo: FAILED")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
