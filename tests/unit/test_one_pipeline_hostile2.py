"""A second hostile read (issue #15): lazy conjugate / negative bits, non-strided tensors, keys= that select nothing
or are not a list, DCP chunks listed twice, verify agreeing with what read refuses."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

import liferaft


def _dcp(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_dcp_blobs_of_conjugate_and_negative_views_read_as_dcp_loads_them(tmp_path):
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    d = str(tmp_path / "dcp")
    _dcp(d, {"c": z.conj(), "n": torch.arange(3.0)._neg_view()})
    got = liferaft.read(d)
    assert torch.equal(got["c"], z.conj().resolve_conj()) and torch.equal(got["n"], -torch.arange(3.0))
    state = {"c": torch.zeros(4, dtype=torch.complex64), "n": torch.zeros(3)}
    liferaft.load(d, state)
    assert torch.equal(state["c"], z.conj().resolve_conj()) and torch.equal(state["n"], -torch.arange(3.0))


def test_conjugate_views_save_as_what_they_read_as_and_sparse_tensors_are_refused(tmp_path):
    z = torch.complex(torch.arange(4.0), torch.ones(4))
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"c": z.conj(), "n": torch.arange(3.0)._neg_view()})
    got = liferaft.read(ck)
    assert torch.equal(got["c"], z.conj().resolve_conj()) and torch.equal(got["n"], -torch.arange(3.0))
    with pytest.raises(liferaft.InvalidStateError, match="to_dense"):
        liferaft.save(str(tmp_path / "sp"), {"s": torch.eye(3).to_sparse()})
    with pytest.raises(liferaft.InvalidStateError, match="conjugate"):
        liferaft.load(ck, {"c": torch.zeros(4, dtype=torch.complex64).conj(), "n": torch.zeros(3)})


def test_keys_that_select_nothing_or_are_not_a_list_are_refused_everywhere(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    liferaft.save(a, {"model": {"w": torch.zeros(2)}})
    liferaft.save(b, {"model": {"w": torch.ones(2)}})
    for call in (lambda k: liferaft.diff(a, b, keys=k), lambda k: liferaft.describe(a, k),
                 lambda k: liferaft.convert(a, str(tmp_path / "out.pt"), "torch", keys=k)):
        with pytest.raises(liferaft.OptionsError, match="typo"):
            call(["typo"])
        for bad in ("model", [""], [5], iter(["model"])):
            with pytest.raises(liferaft.OptionsError):
                call(bad)
    with pytest.raises(liferaft.OptionsError):
        liferaft.read(a, iter(["model"]))
    assert not liferaft.diff(a, b, keys=["model"]).identical


def test_dcp_chunks_listed_twice_or_outside_the_shape_are_refused(tmp_path):
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    d = str(tmp_path / "dcp")
    _dcp(d, {"w": torch.arange(40.0).reshape(8, 5)})
    meta_path = os.path.join(d, ".metadata")
    original = open(meta_path, "rb").read()
    for extra in (ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([8, 5])),
                  ChunkStorageMetadata(offsets=torch.Size([100, 0]), sizes=torch.Size([0, 5]))):
        meta = pickle.loads(original)
        meta.state_dict_metadata["w"].chunks.append(extra)
        with open(meta_path, "wb") as f:
            pickle.dump(meta, f)
        for call in (lambda: liferaft.read(d), lambda: liferaft.inspect(d), lambda: liferaft.verify(d)):
            with pytest.raises(liferaft.CorruptCheckpointError, match="twice|outside"):
                call()


def test_verify_finds_what_read_refuses(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, str(folder / "model-1.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-1.safetensors", "gone": "model-1.safetensors"}}))
    with pytest.raises(liferaft.CorruptCheckpointError, match="gone"):
        liferaft.read(str(folder))
    with pytest.raises(liferaft.CorruptCheckpointError, match="gone"):
        liferaft.verify(str(folder))


def test_a_torch_file_reader_releases_its_mapping_when_closed(tmp_path):
    from liferaft.core.open import open_reader

    path = str(tmp_path / "m.pt")
    torch.save({"w": torch.ones(1 << 16)}, path)
    r = open_reader(path)
    assert any(path in line for line in open("/proc/self/maps"))
    r.close()
    import gc

    gc.collect()
    assert not any(path in line for line in open("/proc/self/maps"))
