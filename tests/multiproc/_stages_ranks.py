"""Rank functions for pipeline stages under FSDP2 (imported as ``multiproc._stages_ranks``): 4 ranks as 2 stages of
2 data-parallel ranks each; each stage holds its own layers (their names kept, as torchtitan's pipeline split keeps
them), sharded by FSDP2 over the stage's sub-mesh, with AdamW, a plain tensor of the stage and one every rank
holds."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import liferaft
from liferaft.core.caches import PLANS, STAGED

#: the layers of each stage (in, out)
LAYERS = {"l0": (16, 33), "l1": (33, 33), "l2": (33, 10), "l3": (10, 6)}
STAGES = (("l0", "l1"), ("l2", "l3"))


def full_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({k: nn.Linear(i, o) for k, (i, o) in LAYERS.items()})


def stage_model(stage: int) -> nn.ModuleDict:
    """The layers of ``stage``, with their names and initial values from the whole model."""
    model = full_model()
    for k in list(model):
        if k not in STAGES[stage]:
            del model[k]
    return model


def train(model: nn.ModuleDict, opt: torch.optim.Optimizer, stage: int, steps: int) -> None:
    g = torch.Generator().manual_seed(7 + stage)
    first = LAYERS[STAGES[stage][0]][0]
    for _ in range(steps):
        x = torch.randn(4, first, generator=g)
        for k in STAGES[stage]:
            x = torch.relu(model[k](x))
        x.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def make(rank: int, pp: int, dp: int, lr: float = 0.01) -> tuple[nn.ModuleDict, torch.optim.Optimizer, int]:
    """This rank's stage model, sharded by FSDP2 over its stage's sub-mesh when ``dp`` > 1, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stage = rank // dp
    model = stage_model(stage)
    if dp > 1:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        for k in STAGES[stage]:
            fully_shard(model[k], mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=lr), stage


def reference(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This stage's full parameters and optimizer state (gathered over its data-parallel ranks), by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    osd = get_optimizer_state_dict(model, opt, options=o)
    return {"model": {k: full(v).clone() for k, v in get_model_state_dict(model, options=o).items()},
            "optim": {k: {n: full(t).clone() for n, t in s.items()} for k, s in osd["state"].items()}}


def state(model: nn.Module, opt: torch.optim.Optimizer, stage: int, step: int) -> dict[str, Any]:
    return {"model": model, "optim": opt, "stage_state": {f"s{stage}": torch.full((5,), float(stage + step))},
            "shared": torch.arange(6.0) + step, "step": step}


def save(rank: int, world: int, paths: list[str], ref_path: str) -> list[Any]:
    """Train PP 2 × FSDP2 2 and save to each of ``paths`` (one more step before each); write each stage's
    reference beside; return how each save was planned and how many stage plans this rank keeps."""
    model, opt, stage = make(rank, 2, 2)
    out, agreed = [], None
    for i, p in enumerate(paths):
        train(model, opt, stage, 2)
        ref = reference(model, opt)
        if rank % 2 == 0:
            torch.save(ref, f"{ref_path}.{i}.{stage}")
        liferaft.save(p, state(model, opt, stage, i))
        kept = STAGED.items()[-1][1] if len(STAGED) else None
        # (the same entry: the agreement was reused, not exchanged again; the step counts changed meanwhile)
        out.append(("layouts" if PLANS.items()[-1][1][0][:1] == ("layouts",) else "gathered", len(STAGED),
                    "reused" if kept is not None and kept is agreed else "exchanged"))
        agreed = kept
    return out


def load(rank: int, world: int, path: str, ref_path: str, step: int, pp_dp: tuple[int, int]) -> list[str]:
    """Load the save of ``step`` (its stages' references at ``ref_path``) into ``pp_dp`` (pipeline ×
    data-parallel ranks) with other values; the keys that differ from the saving stage's reference."""
    model, opt, stage = make(rank, *pp_dp, lr=0.5)
    for p in model.parameters():
        (p.data.to_local() if hasattr(p.data, "to_local") else p.data).zero_()
    st = state(model, opt, stage, -1)
    # (each stage's optimizer names its own parameters in its param_groups: a value per saving rank, which maps
    # onto the same ranks only; the optimizer's state is loaded all the same)
    result = liferaft.load(path, st, strict=pp_dp == (2, 2))
    ref = torch.load(f"{ref_path}.{step}.{stage}")
    got = reference(model, opt)
    bad = [k for k in ref["model"] if not torch.equal(ref["model"][k], got["model"][k])]
    bad += [f"{k}.{n}" for k, s in ref["optim"].items() for n, t in s.items() if not torch.equal(t, got["optim"][k][n])]
    expect = state(model, opt, stage, step)
    if st["step"] != step or not torch.equal(st["shared"], expect["shared"]) or \
            not torch.equal(st["stage_state"][f"s{stage}"], expect["stage_state"][f"s{stage}"]):
        bad.append("rest")
    if list(result.missing_keys) not in ([], ["optim.param_groups"]):
        bad.append(f"missing {result.missing_keys}")
    return bad


def load_expect_error(rank: int, world: int, path: str, ref_path: str) -> str:
    try:
        load(rank, world, path, ref_path, 0, (2, 2))
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def save_diverged(rank: int, world: int, path: str) -> tuple[str, list[float]]:
    """PP 2 × FSDP2 2 whose plain tensor every rank holds differs on rank 3: planned gathered (its copies are
    stored per rank); then loaded back on the same ranks: each rank's own copy."""
    model, opt, stage = make(rank, 2, 2)
    train(model, opt, stage, 1)
    st = state(model, opt, stage, 0)
    if rank == 3:
        st["shared"] = st["shared"] + 100
    liferaft.save(path, st)
    kind = "layouts" if PLANS.items()[-1][1][0][:1] == ("layouts",) else "gathered"
    back = state(model, opt, stage, 0)
    back["shared"] = torch.zeros(6)
    liferaft.load(path, back)
    return kind, back["shared"].tolist()


def save_async(rank: int, world: int, path: str, ref_path: str) -> str:
    """``save`` through ``async_save``: planned by stages on the background thread's own group."""
    model, opt, stage = make(rank, 2, 2)
    train(model, opt, stage, 2)
    ref = reference(model, opt)         # (collective within the stage)
    if rank % 2 == 0:
        torch.save(ref, f"{ref_path}.0.{stage}")
    liferaft.async_save(path, state(model, opt, stage, 0)).wait()
    return "layouts" if PLANS.items()[-1][1][0][:1] == ("layouts",) else "gathered"


def save_conflicting(rank: int, world: int, path: str, kind: str) -> str:
    """PP 2 × DP 2 whose key ``x`` is a value on stage 0 and, on stage 1, a tensor (``kind`` "tensor") or a dict
    (``"dict"``); ``"tensor-dict"``: a tensor on stage 0, a dict on stage 1. The save's error, or "committed"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    st: dict[str, Any] = {f"w{stage}": distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh["dp"], [Shard(0)])}
    if kind == "tensor-dict":
        st["x"] = torch.ones(3) if stage == 0 else {"t": torch.ones(3)}
    else:
        st["x"] = 1 if stage == 0 else torch.ones(3) if kind == "tensor" else {"t": torch.ones(3)}
    try:
        liferaft.save(path, st, options=liferaft.SaveOptions(overwrite=True))
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


def save_options_differ(rank: int, world: int, path: str) -> str:
    """PP 2 × DP 2 whose second stage passes another ``chunk_bytes``: the save's error, or "committed"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    st = {f"w{stage}": distribute_tensor(torch.arange(200_000.0).reshape(1000, 200), mesh["dp"], [Shard(0)])}
    try:
        liferaft.save(path, st, options=liferaft.SaveOptions(chunk_bytes=64 << 10) if stage else None)
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


def save_alike_names(rank: int, world: int, path: str, tied: bool, own_key: bool = True,
                     base: str | None = None, swap: bool = False) -> str:
    """PP 2 × FSDP2 2 whose stages both name their layer ``0`` (stage-local names, as an ``nn.Sequential`` per
    stage gives): with ``tied``, both stages hold the same values (a tied weight kept in sync: seed 0), else
    their own (seed = stage); ``own_key``: each stage also holds a key of its own (the ranks then describe
    different tensors), else every rank describes the same; ``base``: first save to ``base``, then save
    incrementally on it; ``swap``: both stages hold the same rows, the second stage's in the
    other order (its two halves swapped). The save's error, or "committed"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0 if tied or swap or base else stage)
    model = nn.Sequential(nn.Linear(64, 64))
    if swap and stage == 1:
        with torch.no_grad():
            model[0].weight.copy_(model[0].weight.roll(32, 0))
    fully_shard(model, mesh=mesh["dp"])
    try:
        st: dict[str, Any] = {"model": model}
        if own_key:
            st[f"stage{stage}"] = torch.ones(2)
        if base is not None:    # (equal at the first save; then each stage steps on its own)
            liferaft.save(base, st, options=liferaft.SaveOptions(chunk_bytes=64 << 10))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(stage + 1.0)
        liferaft.save(path, st, options=liferaft.SaveOptions(
            chunk_bytes=64 << 10, incremental_base=None if base is None else base.rsplit("/", 1)[-1]))
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


def save_batchnorm(rank: int, world: int, path: str) -> str:
    """FSDP2 over 4 ranks with BatchNorm (its running statistics differ per rank) and a key per rank (the ranks then
    describe different tensors): saves, its buffers taken on trust as replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model(torch.randn(16, 8, generator=torch.Generator().manual_seed(rank)))       # (statistics per rank)
    try:
        liferaft.save(path, {"model": model, "data": {f"dp_rank_{rank}": torch.full((2,), float(rank))}})
    except liferaft.LiferaftError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


def save_strided_or_switched(rank: int, world: int, root: str, how: str) -> list[str]:
    """Stages that name a tensor ``w`` alike with different values, saved after a legitimate save:
    ``"strided"``: a ``_StridedShard(0, 2)`` DTensor on the stage's sub-mesh (each rank's shard holds two boxes);
    ``"switched"``: first a DTensor on the root mesh replicated along the stages with equal values (trusted), then
    on the stage's sub-mesh with the stages' own values (the repeated save must not reuse the first's
    agreement). Each save's error, or "committed"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, d = rank // 2, rank % 2
    same = torch.arange(32.0).reshape(8, 4)
    own = same + 100 * stage
    out = []

    def attempt(path: str, st: dict[str, Any]) -> None:
        try:
            liferaft.save(path, st)
            out.append("committed")
        except liferaft.LiferaftError as e:
            out.append(f"{type(e).__name__}: {e}")
    if how == "strided":            # (rank d holds rows 2d, 2d+1 and 4+2d, 4+2d+1)
        def strided(full: torch.Tensor) -> Any:
            local = torch.cat([full[2 * d:2 * d + 2], full[4 + 2 * d:6 + 2 * d]]).clone()
            return DTensor.from_local(local, mesh["dp"], [_StridedShard(0, split_factor=2)], run_check=False)
        attempt(f"{root}/a", {"w": strided(same), f"own{stage}": torch.ones(2)})
        attempt(f"{root}/b", {"w": strided(own), f"own{stage}": torch.ones(2)})
    else:
        rows = slice(4 * d, 4 * d + 4)
        attempt(f"{root}/a", {"w": DTensor.from_local(same[rows].clone(), mesh, [Replicate(), Shard(0)],
                                                      run_check=False), f"own{stage}": torch.ones(2)})
        attempt(f"{root}/b", {"w": DTensor.from_local(own[rows].clone(), mesh["dp"], [Shard(0)], run_check=False),
                              f"own{stage}": torch.ones(2)})
    return out
