"""What a hostile read of the one pipeline found (issue #15): crafted DCP chunks that overlap and leave a gap, a
truncated DCP blob behind a good one, a Hugging Face folder whose shards hold one key twice, per-rank plain values
under strict=False, readers left open after a failed load, keys with glob characters."""

from __future__ import annotations

import os
import pickle

import pytest
import safetensors.torch
import torch

import liferaft


def _dcp(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _rewrite_meta(path: str, change) -> None:
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    change(meta)
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


def test_dcp_chunks_that_overlap_and_leave_a_gap_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    d = str(tmp_path / "dcp")
    _dcp(d, {"w": torch.arange(40.0).reshape(8, 5)})

    def overlap(meta):
        md = meta.state_dict_metadata["w"]
        info = meta.storage_data[MetadataIndex("w", (0, 0))]
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 5])),
                     ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([4, 5]))]
        meta.storage_data = {MetadataIndex("w", (0, 0)): info, MetadataIndex("w", (2, 0)): info}
    _rewrite_meta(d, overlap)
    for call in (lambda: liferaft.read(d), lambda: liferaft.load(d, {"w": torch.zeros(8, 5)}),
                 lambda: liferaft.inspect(d), lambda: liferaft.verify(d)):
        with pytest.raises(liferaft.CorruptCheckpointError, match="overlap"):
            call()


@pytest.mark.parametrize("field,value", [("offset", "abc"), ("offset", -5), ("relative_path", None)])
def test_crafted_dcp_metadata_fields_are_a_clear_error(tmp_path, field, value):
    d = str(tmp_path / "dcp")
    _dcp(d, {"w": torch.arange(4.0), "v": {"x": 1}})

    def craft(meta):
        for info in meta.storage_data.values():
            if value is None:
                delattr(info, field)
            else:
                object.__setattr__(info, field, value)
    _rewrite_meta(d, craft)
    with pytest.raises(liferaft.CorruptCheckpointError):
        liferaft.load(d, {"w": torch.zeros(4), "v": {}})


def test_a_truncated_dcp_blob_changes_nothing_before_it_is_refused(tmp_path):
    d = str(tmp_path / "dcp")
    _dcp(d, {"a": torch.ones(1000), "b": torch.full((1000,), 2.0)})
    data = next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".distcp"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)             # inside the last blob
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    with pytest.raises(liferaft.CorruptCheckpointError):
        liferaft.load(d, state)
    assert torch.count_nonzero(state["a"]) == 0 and torch.count_nonzero(state["b"]) == 0


def test_a_key_in_two_shards_of_a_hf_folder_is_refused(tmp_path):
    import json

    folder = tmp_path / "hf"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, str(folder / "model-1.safetensors"))
    safetensors.torch.save_file({"w": torch.full((2,), 2.0), "u": torch.zeros(1)}, str(folder / "model-2.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-1.safetensors", "u": "model-2.safetensors"}}))
    with pytest.raises(liferaft.CorruptCheckpointError, match="'w'"):
        liferaft.read(str(folder))
    with pytest.raises(liferaft.CorruptCheckpointError, match="'w'"):
        liferaft.load(str(folder), {"w": torch.zeros(2), "u": torch.zeros(1)})


def test_per_rank_plain_values_follow_strict_false(tmp_path):
    """A value that differed per saving rank cannot map onto another world size: strict refuses, strict=False
    leaves it and lists it as missing (as tensors stored per rank always did)."""
    from liferaft.testing import run_ranks

    ck = str(tmp_path / "ck")
    run_ranks(_save_per_rank_value, 2, ck)
    state = {"w": torch.zeros(3), "r": -1}
    with pytest.raises(liferaft.StateMismatchError, match="'r'"):
        liferaft.load(ck, state)
    res = liferaft.load(ck, state, strict=False)
    assert res.missing_keys == ("r",) and state["r"] == -1 and torch.equal(state["w"], torch.ones(3))


def _save_per_rank_value(rank: int, world: int, path: str) -> None:
    liferaft.save(path, {"w": torch.ones(3), "r": rank})


def test_a_failed_load_closes_its_reader(tmp_path):
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_file({"w": torch.ones(4)}, path)

    def open_fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    def mapped() -> int:
        return sum(path in line for line in open("/proc/self/maps"))
    before = mapped()
    with pytest.raises(liferaft.StateMismatchError):
        liferaft.load(path, {"w": torch.zeros(5)})
    import gc

    gc.disable()
    try:
        assert path not in open_fds() and mapped() <= before
    finally:
        gc.enable()


def test_ranks_that_see_different_things_at_the_path_fail_at_once(tmp_path):
    from liferaft.testing import run_ranks

    d = str(tmp_path / "dcp")
    _dcp(d, {"w": torch.ones(2)})
    assert run_ranks(_load_seen_differently, 2, d) == ["StateMismatchError"] * 2


def _load_seen_differently(rank: int, world: int, path: str) -> str:
    try:
        liferaft.load(path if rank == 0 else path + "-elsewhere", {"w": torch.zeros(2)},
                      options=liferaft.LoadOptions(timeout=120))
    except liferaft.LiferaftError as e:
        return type(e).__name__
    return "loaded"


def test_a_key_with_glob_characters_is_selected_alone_when_escaped(tmp_path):
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"layer[0]": torch.ones(1), "layer0": torch.zeros(1)})
    assert sorted(liferaft.read(ck, ["layer[0]"])) == ["layer0", "layer[0]"]  # the key, and the glob's match
    assert sorted(liferaft.read(ck, ["layer[[]0]"])) == ["layer[0]"]         # escaped: the key itself
