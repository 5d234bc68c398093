"""CheckFree against a restore from a checkpoint: the loss after a pipeline stage is lost (docs/CHECKFREE.md).

A GPT-style model (examples/train_gpt.py's blocks, ``--layers`` of them) split into ``--stages`` pipeline stages of
equal blocks (the embedding and the head stay with the first and last stage and are not rebuilt), trained with
AdamW on the example's synthetic data, in one process (the arithmetic of a pipeline; ``liferaft.rebuild_stage``
does the same over a process group, tests/multiproc/test_checkfree.py). At step ``--fail-at`` stage ``--lost``
loses its weights and optimizer state. Three runs from the same start, the same batches:

- **uninterrupted**: nothing lost;
- **CheckFree**: the stage rebuilt as the average of its neighbour stages weighted by their last gradients' norms
  (``liferaft.manager.checkfree.average``), its optimizer state cleared, training goes on at once (no step redone);
- **checkpoint**: the whole state restored from the last checkpoint (every ``--every`` steps) and the steps since it
  trained again.

Prints the loss (mean of 10 steps) at points after the failure, the steps each run has done in all, and how many
extra steps each needed to get within 1 % of the uninterrupted run's loss at the same point.

    python benchmarks/bench_checkfree.py [--steps 600] [--fail-at 300] [--every 100] [--layers 8] [--stages 4]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys

import torch
from _common import ROOT, machine  # sets up the paths

sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_gpt import GPT, SEQ, SOURCES, VOCAB, tokens

from liferaft.manager.checkfree import average


def batch(step: int, size: int) -> torch.Tensor:
    names = list(SOURCES)
    return torch.stack([tokens(names[(step * size + i) % len(names)], step * size + i) for i in range(size)])


NORMS: list[float] = []          # each stage's gradient norm at the last step (what a neighbour reports)


def train(model: GPT, opt: torch.optim.Optimizer, step: int, size: int, stages: int = 0) -> float:
    ids = batch(step, size)
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    if stages:
        NORMS[:] = [sum(float(p.grad.double().pow(2).sum()) for b in stage_blocks(model, stages, i)
                        for p in b.parameters() if p.grad is not None) ** 0.5 for i in range(stages)]
    opt.step()
    opt.zero_grad()
    return float(loss)


def stage_blocks(model: GPT, stages: int, i: int) -> list[torch.nn.Module]:
    per = len(model.blocks) // stages
    return list(model.blocks[i * per:(i + 1) * per])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--fail-at", type=int, default=300)
    ap.add_argument("--every", type=int, default=100, help="checkpoint interval (steps)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lost", type=int, default=2, help="the stage lost (not the first or the last)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(args.dim, args.layers, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    curves: dict[str, list[float]] = {}
    saved = None
    losses = []
    for step in range(args.fail_at):
        if step % args.every == 0:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), step)
        losses.append(train(model, opt, step, args.batch, args.stages if step == args.fail_at - 1 else 0))
    at_failure = (copy.deepcopy(model), losses[:])
    norms = NORMS[:]

    def go_on(m: GPT, o: torch.optim.Optimizer, start: int, done: list[float]) -> list[float]:
        for step in range(start, args.steps):
            done.append(train(m, o, step, args.batch))
        return done

    # uninterrupted
    m, o = copy.deepcopy(at_failure[0]), None
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    o.load_state_dict(opt.state_dict())
    curves["uninterrupted"] = go_on(m, o, args.fail_at, at_failure[1][:])
    # CheckFree: stage `lost` rebuilt from its neighbours
    m = copy.deepcopy(at_failure[0])
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    o.load_state_dict(opt.state_dict())
    lost = stage_blocks(m, args.stages, args.lost)
    lost_params = {id(p) for b in lost for p in b.parameters()}
    for p in list(o.state):
        if id(p) in lost_params:
            del o.state[p]                            # its optimizer state went with it
    nb = [args.lost - 1, args.lost + 1]
    w = [norms[j] for j in nb]
    w = [x / sum(w) for x in w]
    srcs = [[t for b in stage_blocks(m, args.stages, j) for t in b.state_dict().values()] for j in nb]
    average(srcs, w, [t for b in lost for t in b.state_dict().values()])
    curves["CheckFree"] = go_on(m, o, args.fail_at, at_failure[1][:])
    # checkpoint: back to the last save, the steps since redone
    assert saved is not None
    m = GPT(args.dim, args.layers, SEQ)
    m.load_state_dict(saved[0])
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    o.load_state_dict(saved[1])
    redo = at_failure[1][:saved[2]]
    curves["checkpoint"] = go_on(m, o, saved[2], redo)   # its steps: fail_at - saved step more in all

    def mean(c: list[float], i: int) -> float:
        return statistics.fmean(c[max(0, i - 9):i + 1])

    # compared at equal compute: d steps after the failure, the uninterrupted and CheckFree runs are at training
    # step fail_at + d, the checkpoint run at saved + d (it first redoes the steps since its last checkpoint)
    start = {"uninterrupted": args.fail_at, "CheckFree": args.fail_at, "checkpoint": saved[2]}
    after = [d for d in (1, 10, 50, 100, 150, 200, 300) if args.fail_at + d < args.steps] + \
        [args.steps - 1 - args.fail_at]
    print(f"### CheckFree vs a checkpoint restore, {datetime.date.today().isoformat()}: {machine()}\n")
    print(f"GPT {args.layers} blocks × dim {args.dim} in {args.stages} stages; stage {args.lost} lost after step "
          f"{args.fail_at}; checkpoints every {args.every} steps (the last at step {saved[2]}); batch {args.batch}; "
          f"loss = mean of 10 steps; columns: training steps run after the failure (equal compute). CheckFree's "
          f"weights: {w[0]:.2f} (stage {nb[0]}), {w[1]:.2f} (stage {nb[1]}).\n")
    print("| run | " + " | ".join(f"+{d}" for d in after) + " |")
    print("|---|" + "---|" * len(after))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{mean(c, start[name] + d):.4f}" for d in after
                                          if start[name] + d < len(c)) + " |")
    level = mean(curves["uninterrupted"], args.fail_at - 1)
    print(f"\nThe loss at the failure: {level:.4f}. Steps after the failure until a run is back at it:")
    for name in ("CheckFree", "checkpoint"):
        c = curves[name]
        back = next((d for d in range(1, len(c) - start[name]) if mean(c, start[name] + d) <= level), None)
        print(f"- {name}: {back if back is not None else 'not within this run'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
