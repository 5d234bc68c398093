"""Edges of the manager met in a first week: restore right after an async save, a foreign checkpoint folder under
the manager's own step name, job ids as `ls` shows them, and `liferaft.load` given a torch.save file."""

from __future__ import annotations

import os

import pytest
import torch

import liferaft
from liferaft import JobOptions
from liferaft.cli import main


def test_restore_sees_the_save_still_in_flight(tmp_path):
    root = str(tmp_path / "run")
    with liferaft.CheckpointManager(root, every_steps=1, async_save=True) as mgr:
        state = {"w": torch.zeros(1 << 23), "step": 0}
        for step in range(3):
            state["w"].fill_(float(step))
            state["step"] = step
            mgr.maybe_save(step, state)          # returns once the snapshot is taken; the write goes on
        got = {"w": torch.empty(1 << 23), "step": -1}
        assert mgr.restore(got) == 2             # not step 1: the save of step 2 commits first
        assert got["step"] == 2 and bool((got["w"] == 2.0).all())


def test_a_foreign_folder_under_a_step_name_is_not_cleaned_up_as_a_leftover(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "run"
    dcp_step = root / "step-0000000010"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(dcp_step))        # a DCP checkpoint named like our steps
    leftover = root / "step-0000000012" / "data" / "0123456789abcdef"        # (a save id: 16 hex digits)
    leftover.mkdir(parents=True)
    (leftover / "r00000.bin").write_bytes(b"x" * 10)                     # an interrupted liferaft save
    with pytest.warns(UserWarning, match="holds files liferaft does not write"):   # (given on this thread)
        mgr = liferaft.CheckpointManager(str(root), every_steps=1)
        mgr.close()
    assert (dcp_step / ".metadata").exists()
    assert not (root / "step-0000000012").exists()


def test_ls_shows_whole_job_ids(tmp_path, capsys):
    root = str(tmp_path / "run")
    job = "torchrun:a-rather-long-host-name.example.org:123456:987654321"
    with liferaft.CheckpointManager(root, every_steps=1, async_save=False, job=JobOptions(job_id=job)) as mgr:
        mgr.save(0, {"w": torch.ones(2)})
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert job in out                        # whole (it used to be cut to 16 characters: "torchrun:a-rathe")


def test_load_of_a_torch_save_file_reads_it_with_weights_only(tmp_path):
    """One load pipeline for every format: a torch.save file loads (weights_only, nothing run) and is untouched;
    a file that is no checkpoint at all is refused naming it."""
    path = str(tmp_path / "model.pt")
    torch.save({"w": torch.ones(2)}, path)
    state = {"w": torch.zeros(2)}
    liferaft.load(path, state)
    assert torch.equal(state["w"], torch.ones(2)) and os.path.exists(path)
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    with pytest.raises(liferaft.CorruptCheckpointError, match="notes.txt"):
        liferaft.load(str(junk), state)


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_manager_save_is_never_skipped_by_if_busy(tmp_path, async_mode):
    """SaveOptions(if_busy="skip") given to the manager must not make a save it decided on vanish: with another
    save of the process in flight, the step was recorded as committed (sync) or an AssertionError raised (async)."""
    import threading

    from liferaft.storage import register_scheme
    from liferaft.testing.faults import GatedStorage

    register_scheme("gatedmgr", GatedStorage)
    GatedStorage.gate.clear()
    other = liferaft.async_save(f"gatedmgr://{tmp_path / 'other'}", {"x": torch.ones(1 << 16)})
    threading.Timer(0.5, GatedStorage.gate.set).start()
    mgr = liferaft.CheckpointManager(str(tmp_path / "root"), async_save=async_mode,
                                     save_options=liferaft.SaveOptions(if_busy="skip"))
    try:
        mgr.save(3, {"w": torch.arange(4.0)})
        mgr.wait()
        assert [i.step for i in liferaft.ls(str(tmp_path / "root")) if i.status == "committed"] == [3]
    finally:
        mgr.close()
        GatedStorage.gate.set()
        assert other is not None
        other.wait()
