"""Rank functions for the FSDP2 + Adam tests (imported by child processes as ``multiproc._fsdp_ranks``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import liferaft


def make_model(hidden: int = 33) -> nn.Module:
    """33 hidden units: FSDP2 shards unevenly; TP needs a size its ranks divide (32)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 50, (8, 5), generator=g)
        loss = model(ids).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def shard(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_reference(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (gathered) params and optimizer state keyed by parameter name — for comparison only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd = get_model_state_dict(model, options=o)
    osd = get_optimizer_state_dict(model, opt, options=o)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    return {"model": {k: full(v).clone() for k, v in msd.items()},
            "optim": {k: {n: full(t).clone() for n, t in s.items()} for k, s in osd["state"].items()},
            "lr": [g["lr"] for g in osd["param_groups"]]}


def save_fsdp(rank: int, world: int, path: str, ref_path: str) -> None:
    model = shard(make_model(), world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, 3)
    ref = full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
    liferaft.save(path, {"model": model, "optim": opt, "step": 3})
    # nothing was gathered: each rank's model params are still its own shards


def compare(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    bad = [k for k in ref["model"] if not torch.equal(ref["model"][k], got["model"][k])]
    for k, st in ref["optim"].items():
        bad += [f"{k}.{n}" for n, t in st.items() if not torch.equal(t, got["optim"][k][n])]
    if ref["lr"] != got["lr"]:
        bad.append("lr")
    return bad


def load_fsdp(rank: int, world: int, path: str, ref_path: str) -> list[str]:
    model = shard(make_model(), world)
    for p in model.parameters():       # make sure values come from the checkpoint
        p.data.zero_() if not hasattr(p.data, "to_local") else p.data.to_local().zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt, "step": 0}
    liferaft.load(path, state)
    got = full_reference(model, opt)
    bad = compare(torch.load(ref_path), got)
    if state["step"] != 3:
        bad.append("step")
    # and training continues from the loaded state
    train(model, opt, 1)
    return bad


def tensor_parallel(model: nn.Module, world: int) -> nn.Module:
    """Megatron-style TP of the MLP part: layer 1 column-wise, layer 3 row-wise (DTensor parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    return parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})


def _train_and_save(model: nn.Module, rank: int, path: str, ref_path: str, steps: int = 2) -> None:
    """AdamW, ``steps`` steps, the gathered reference to ``ref_path`` (rank 0), then liferaft.save of the shards."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, steps)
    ref = full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
    liferaft.save(path, {"model": model, "optim": opt})


def _load_and_compare(model: nn.Module, path: str, ref_path: str) -> list[str]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    liferaft.load(path, {"model": model, "optim": opt})
    return compare(torch.load(ref_path), full_reference(model, opt))


def save_tp(rank: int, world: int, path: str, ref_path: str) -> None:
    _train_and_save(tensor_parallel(make_model(32), world), rank, path, ref_path)


def load_tp(rank: int, world: int, path: str, ref_path: str) -> list[str]:
    return _load_and_compare(tensor_parallel(make_model(32), world), path, ref_path)


def fsdp_tp(model: nn.Module, dp: int, tp: int) -> nn.Module:
    """FSDP2 over ``dp`` on top of TP over ``tp`` (a 2-D mesh): params get a strided shard on the dp dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def save_fsdp_tp(rank: int, world: int, path: str, ref_path: str, hidden: int = 32) -> tuple[list[str], str]:
    """Returns the parameters' placement types and how the save was planned ("layouts": by each rank on its own).
    ``hidden`` odd: TP splits the hidden rows unevenly (17, 16), and FSDP2's strided rows interleave (saved as
    initialized: this torch's TP cannot run the uneven forward)."""
    from multiproc._own_plan_ranks import planned_how

    model = fsdp_tp(make_model(hidden), 2, 2)
    _train_and_save(model, rank, path, ref_path, 2 if hidden % 2 == 0 else 0)
    return sorted({type(p).__name__ for v in model.parameters() for p in v.placements}), planned_how()


def load_fsdp_tp(rank: int, world: int, path: str, ref_path: str, hidden: int = 32) -> list[str]:
    return _load_and_compare(fsdp_tp(make_model(hidden), 2, 2), path, ref_path)


def shard_mp(model: nn.Module, world: int, reshard: bool) -> nn.Module:
    """FSDP2 with a bf16 compute / fp32 reduce mixed-precision policy; ``reshard`` = reshard_after_forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


def mp_roundtrip(rank: int, world: int, path: str, reshard: bool) -> list[str]:
    """Train 2 steps, save, train 2 more (the reference); load the save into a fresh model with the same policy,
    train the same 2 steps: everything bitwise equal."""
    model = shard_mp(make_model(), world, reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2)
    liferaft.save(path, {"model": model, "optim": opt})
    train(model, opt, 2)
    ref = full_reference(model, opt)
    torch.manual_seed(5)
    fresh = shard_mp(nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 10)), world,
                     reshard)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    liferaft.load(path, {"model": fresh, "optim": opt2})
    train(fresh, opt2, 2)
    return compare(ref, full_reference(fresh, opt2))
