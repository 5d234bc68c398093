"""A save whose folder another program removes while it runs (a framework's clean-up of old checkpoints did, the
Hugging Face Trainer's rotation under an async save) fails, and is not committed without its data. The writes are
held at a gate (``liferaft.testing.faults.GatedStorage``, real POSIX files) while the folder is removed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import liferaft
from liferaft.errors import LiferaftError
from liferaft.storage import register_scheme
from liferaft.testing.faults import GatedStorage


@pytest.fixture
def gated():
    register_scheme("gatedrm", GatedStorage)
    GatedStorage.gate.clear()
    yield
    GatedStorage.gate.set()


@pytest.mark.parametrize("what", ["removed", "emptied"])
def test_a_folder_removed_under_an_async_save_fails_it_uncommitted(tmp_path, gated, what):
    path = str(tmp_path / "ck")
    handle = liferaft.async_save(f"gatedrm://{path}", {"w": torch.arange(1 << 16, dtype=torch.float32)})
    data = os.path.join(path, "data")
    for _ in range(200):                        # the writer has made its file and waits at the gate
        if os.path.isdir(data) and any(files for _, _, files in os.walk(data)):
            break
        GatedStorage.gate.wait(0.01)
    if what == "removed":
        shutil.rmtree(path)
    else:                                       # the files go, the folder stays
        shutil.rmtree(data)
    GatedStorage.gate.set()
    with pytest.raises(LiferaftError, match="right after it was written|writing data file"):
        handle.wait(timeout=60)
    assert not os.path.exists(os.path.join(path, "COMMIT"))
    liferaft.release()
