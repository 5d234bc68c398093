"""A commit on local storage checks that the data files it lists are there first: a folder cleaned up by another
program while a save ran (the Hugging Face Trainer's rotation did) fails the save instead of committing a
checkpoint whose data is gone."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import liferaft
from liferaft.core.commit import open_checkpoint, write_commit
from liferaft.errors import CorruptCheckpointError
from liferaft.storage import resolve


def test_a_commit_over_missing_data_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.arange(1000.0)})
    storage = resolve(path)
    manifest = open_checkpoint(storage)
    os.remove(os.path.join(path, "COMMIT"))
    (data,) = glob.glob(os.path.join(path, "data", "**", "*.bin"), recursive=True)
    with open(data, "r+b") as f:
        f.truncate(10)                                          # changed under the save
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        write_commit(storage, manifest.save_id, manifest)
    os.remove(data)                                             # removed under the save
    with pytest.raises(CorruptCheckpointError, match="missing"):
        write_commit(storage, manifest.save_id, manifest)
    assert not os.path.exists(os.path.join(path, "COMMIT"))


def test_a_commit_of_intact_data_goes_through(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.arange(1000.0)})
    storage = resolve(path)
    manifest = open_checkpoint(storage)
    write_commit(storage, manifest.save_id, manifest)
    assert torch.equal(liferaft.read(path)["w"], torch.arange(1000.0))
