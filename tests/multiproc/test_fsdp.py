"""FSDP2 model + Adam saved on 2 ranks; loaded into a plain model in one process and into FSDP2 on 4 ranks."""

from __future__ import annotations

import pytest
import torch
from multiproc._fsdp_ranks import compare, load_fsdp, make_model, save_fsdp, train

import liferaft
from liferaft.testing import run_ranks


def _saved(tmp_path):
    path, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(save_fsdp, 2, path, ref)
    liferaft.verify(path)
    return path, ref


def _load_in_one_process(path: str, ref_path: str, hidden: int) -> None:
    """Load the checkpoint into a plain model of ``hidden`` units and its AdamW in this process: equal to the
    gathered reference the saving ranks wrote."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = make_model(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    liferaft.load(path, {"model": model, "optim": opt})
    osd = get_optimizer_state_dict(model, opt)
    got = {"model": dict(model.state_dict()), "optim": osd["state"], "lr": [g["lr"] for g in osd["param_groups"]]}
    assert compare(torch.load(ref_path), got) == []


def test_fsdp2_adam_2_ranks_to_plain_model_1_process_and_to_fsdp2_4_ranks(tmp_path):
    path, ref_path = _saved(tmp_path)
    info = liferaft.inspect(path)
    keys = {t.key for t in info.tensors}
    assert "model.1.weight" in keys and "optim.state.1.weight.exp_avg" in keys   # optimizer keyed by param name
    assert max(t.chunks for t in info.tensors) == 2                             # saved as shards, not gathered

    # -> plain model + Adam in one process, no process group
    model = make_model()
    for p in model.parameters():
        p.data.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt, "step": 0}
    liferaft.load(path, state)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    got = {"model": dict(model.state_dict()), "optim": osd["state"], "lr": [g["lr"] for g in osd["param_groups"]]}
    assert compare(torch.load(ref_path), got) == []
    assert state["step"] == 3
    train(model, opt, 1)

    # -> FSDP2 on 4 ranks
    for rank, bad in enumerate(run_ranks(load_fsdp, 4, path, ref_path)):
        assert bad == [], f"rank {rank}: {bad}"


def test_tensor_parallel_2_ranks_to_plain_1_process_and_to_tp_4_ranks(tmp_path):
    from multiproc._fsdp_ranks import load_tp, save_tp

    path, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(save_tp, 2, path, ref_path)
    info = {t.key: t for t in liferaft.inspect(path).tensors}
    assert info["model.1.weight"].chunks == 2 and info["model.3.weight"].chunks == 2   # colwise / rowwise shards
    _load_in_one_process(path, ref_path, 32)
    for rank, bad in enumerate(run_ranks(load_tp, 4, path, ref_path)):
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp2_plus_tp_on_a_2d_mesh_to_plain_to_fsdp2_and_back(tmp_path):
    from multiproc._fsdp_ranks import load_fsdp_tp, save_fsdp_tp

    path, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    saved = run_ranks(save_fsdp_tp, 4, path, ref_path)
    assert "_StridedShard" in saved[0][0], saved               # what FSDP2 over TP produces
    assert all(how == "layouts" for _, how in saved), saved    # planned by each rank on its own
    liferaft.verify(path)
    from liferaft.testing.tamper import read_manifest

    doc, _ = read_manifest(path)       # evenly split: the strided rows are a nested split, TP first (chunk tables)
    assert doc["version"] == 4 and any(t.get("layout", {}).get("order") == [1, 0] for t in doc["tensors"]), doc
    _load_in_one_process(path, ref_path, 32)  # -> one process, plain model
    for rank, bad in enumerate(run_ranks(load_fsdp_tp, 4, path, ref_path)):  # -> FSDP2 + TP again
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp2_plus_tp_split_unevenly_commits_explicit_boxes(tmp_path):
    """33 hidden units over TP 2 (17 and 16 rows): FSDP2's strided rows interleave, no layout describes them;
    each rank plans its own writes from its DTensor's boxes and sends rank 0 its boxes, and the index lists them
    (explicit boxes, chunk tables). It loads exactly into one process and into FSDP2 + TP again."""
    from multiproc._fsdp_ranks import load_fsdp_tp, save_fsdp_tp

    path, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    saved = run_ranks(save_fsdp_tp, 4, path, ref_path, 33)
    assert "_StridedShard" in saved[0][0] and all(how == "layouts" for _, how in saved), saved
    from liferaft.testing.tamper import read_manifest

    doc, _ = read_manifest(path)
    assert doc["version"] == 4 and all("boxes" in t for t in doc["tensors"]), doc["tensors"][0]
    liferaft.verify(path)
    _load_in_one_process(path, ref_path, 33)
    for rank, bad in enumerate(run_ranks(load_fsdp_tp, 4, path, ref_path, 33)):
        assert bad == [], f"rank {rank}: {bad}"



@pytest.mark.parametrize("reshard", [True, False], ids=["reshard_after_forward", "keep_unsharded"])
def test_fsdp2_mixed_precision_resume_is_bitwise(tmp_path, reshard):
    from multiproc._fsdp_ranks import mp_roundtrip

    for rank, bad in enumerate(run_ranks(mp_roundtrip, 2, str(tmp_path / "ck"), reshard)):
        assert bad == [], f"rank {rank}: {bad}"
    dtypes = {t.dtype for t in liferaft.inspect(str(tmp_path / "ck")).tensors}
    assert dtypes == {"float32"}                   # fp32 master params and moments are saved, not the bf16 copies
