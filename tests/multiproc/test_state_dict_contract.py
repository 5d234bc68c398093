"""Issue 14, review items 5 and 7 (2 real ranks).

- A module's or an optimizer's state dict saved as a dict (``{"model": ddp.module.state_dict(), ...}``) follows
  the data-parallel contract like the objects: BatchNorm running statistics, which differ between DDP ranks after
  every forward, are stored once (one holder's copy, as PyTorch DCP does), not per rank, so the checkpoint loads
  on any world size and exports as the model; a plain tensor elsewhere that differs is still stored per rank, and
  every export refuses it by name instead of writing it under its plain name with the shape ``[ranks, ...]``.
- A StatefulDataLoader saved over a subgroup records the subgroup's size, and loads back over it.
"""

from __future__ import annotations

import pytest
import torch
from multiproc._contract_ranks import ddp_bn_save, loader_per_subgroup, net

import liferaft
from liferaft.errors import OptionsError
from liferaft.testing import run_ranks
from liferaft.tools.convert import to_dcp, to_safetensors, to_torch


def test_ddp_state_dicts_are_replicated_by_contract_and_plain_per_rank_tensors_are_not_exported(tmp_path):
    path = str(tmp_path / "ck")
    stats = run_ranks(ddp_bn_save, 2, path)
    assert stats[0] != stats[1]                                     # the running means differ between the ranks
    shapes = {t.key: t.shape for t in liferaft.inspect(path).tensors}
    assert shapes["model.1.running_mean"] == (8,) and shapes["model.1.running_var"] == (8,)
    assert shapes["optim.state.0.momentum_buffer"] == (8, 4)
    assert shapes["mine"] == (2, 3)                                 # a plain tensor: still compared
    tree = liferaft.read(path)
    assert isinstance(tree["model"]["1.running_mean"], torch.Tensor)
    assert tree["model"]["1.running_mean"].tolist() in (pytest.approx(stats[0]), pytest.approx(stats[1]))
    # one process (another world size) loads the model
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    liferaft.load(path, {"model": m.state_dict(), "optim": opt.state_dict()}, strict=False)
    assert torch.equal(m[1].running_mean, tree["model"]["1.running_mean"])
    # the exports refuse the per-rank tensor by name, before writing anything, and take the others
    for export, dst in ((to_safetensors, tmp_path / "st"), (to_torch, tmp_path / "t.pt"), (to_dcp, tmp_path / "dcp")):
        with pytest.raises(OptionsError, match=r"key 'mine' was stored per rank.*--key"):
            export(path, str(dst))
        assert not dst.exists()
    to_safetensors(path, str(tmp_path / "st"), keys=["model.*"])
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "st" / "model.safetensors"))
    net().load_state_dict({k[len("model."):]: v for k, v in out.items()})
    assert out["model.1.running_mean"].shape == (8,)


def test_a_loader_saved_over_a_subgroup_records_its_size_and_loads_over_it(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    assert run_ranks(loader_per_subgroup, 2, str(tmp_path)) == [("same", 1), ("same", 1)]
