"""liferaft behind PyTorch Lightning: a real ``Trainer.fit`` under torchrun (DDP over gloo, CPU) saving through
``LiferaftCheckpointIO``, killed with SIGKILL mid-epoch, resumed with ``ckpt_path="last"`` on 2 and 1 processes (growing to 3: test_transformers.py):
the state the resumed runs start from is the last checkpoint's (parameters, optimizer and scheduler, loops), and on
the same world size the losses continue bit for bit where the killed run left off. In one process: the plugin's
contract (async saves waited for, Lightning's own ``torch.save`` checkpoints still load, links never followed,
options it cannot honour refused)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

import liferaft
from liferaft.errors import OptionsError
from liferaft.integrations.lightning import LiferaftCheckpointIO

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_job.py")
KILL_AT = 10                # global step: epoch 2's second batch on 2 ranks (4 batches per epoch)


def _fit(out: str, ckdir: str, world: int, kill_at: int, resume: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "PL_"))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), JOB, out, ckdir, str(kill_at), resume], capture_output=True, text=True,
                          timeout=300, env={**env, "OMP_NUM_THREADS": "1"})


def _rows(out: str, name: str) -> list[dict]:
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


def test_fit_killed_mid_epoch_resumes_from_last_on_2_and_1_processes(tmp_path):
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    os.makedirs(out)
    first = _fit(out, ck, 2, KILL_AT, "fresh")
    assert first.returncode != 0 and "SIGKILL" in first.stdout + first.stderr, first.stderr[-3000:]
    names = sorted(os.listdir(ck))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names
    for name in names:                      # liferaft checkpoints (folders), every byte verifying
        assert os.path.isdir(os.path.join(ck, name)) and liferaft.verify(os.path.join(ck, name)).chunks > 0
    saved = {r["epoch"]: r for r in _rows(out, "epochs.jsonl")}
    killed = {r["step"]: r["loss"] for r in _rows(out, "steps.jsonl") if r["run"] == "fresh-2"}
    assert max(killed) == KILL_AT
    pristine = str(tmp_path / "ck-as-killed")
    shutil.copytree(ck, pristine, symlinks=True)
    for world in (2, 1):                    # each from the checkpoints as the killed run left them (same paths:
        shutil.rmtree(ck)                   # ModelCheckpoint's state names its files)
        shutil.copytree(pristine, ck, symlinks=True)
        done = _fit(out, ck, world, -1, "last")
        assert done.returncode == 0, done.stderr[-4000:]
        starts = [r for r in _rows(out, "starts.jsonl") if r["run"] == f"last-{world}"]
        assert len(starts) == world, starts
        for s in starts:                    # the state of the end of epoch 1, on every rank
            assert (s["world"], s["global_step"], s["epoch"]) == (world, 8, 2), s
            assert s["params"] == saved[1]["params"], (s, saved[1])
            assert s["lr"] == pytest.approx(0.005)            # StepLR(step_size=2) stepped twice: restored
        ends = [r for r in _rows(out, "epochs.jsonl") if r["run"] == f"last-{world}"]
        assert [r["epoch"] for r in ends] == [2, 3, 4], ends
        if world == 2:                      # the same world: the losses continue bit for bit
            again = {r["step"]: r["loss"] for r in _rows(out, "steps.jsonl") if r["run"] == "last-2"}
            assert [again[s] for s in range(9, KILL_AT + 1)] == [killed[s] for s in range(9, KILL_AT + 1)]
        kept = sorted(n for n in os.listdir(ck) if n.startswith("epoch="))
        assert len(kept) == 2 and "last.ckpt" in os.listdir(ck), kept     # save_top_k=2: the others removed


def _checkpoint() -> dict:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return {"epoch": 3, "global_step": 40, "pytorch-lightning_version": "2.6.6", "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()], "loops": {"fit_loop": {"epoch_progress": {"current": 3}}},
            "callbacks": {"ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}": {"best_model_path": "/x/e=1.ckpt",
                                                                               "best_model_score": torch.tensor(0.5)}},
            "hyper_parameters": {"width": 32, "name": "mlp", "betas": [0.9, 0.99]}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_checkpoint_round_trips_and_a_save_in_flight_is_waited_for(tmp_path, asynchronous):
    io = LiferaftCheckpointIO(async_save=asynchronous)
    ck = _checkpoint()
    path = tmp_path / "epoch=3-step=40.ckpt"
    io.save_checkpoint(ck, path)
    back = io.load_checkpoint(path)         # (waits for the save in flight first)
    assert _same(ck, back)
    io.save_checkpoint({**ck, "epoch": 4}, path)          # over it: Lightning's last.ckpt, again and again
    io.teardown()
    assert io.load_checkpoint(path)["epoch"] == 4
    moved = io.load_checkpoint(path, map_location=lambda t, _: t.double())
    assert moved["state_dict"]["weight"].dtype == torch.float64


def test_lightnings_own_torch_save_checkpoints_still_load(tmp_path):
    """Switching keeps older runs resumable: a checkpoint Lightning's TorchCheckpointIO wrote loads through the
    plugin (liferaft's reader: weights only, nothing run)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    ck = _checkpoint()
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "old.ckpt")
    assert _same(ck, LiferaftCheckpointIO().load_checkpoint(tmp_path / "old.ckpt"))


def test_remove_checkpoint_removes_a_link_never_its_target(tmp_path):
    io = LiferaftCheckpointIO(async_save=False)
    io.save_checkpoint(_checkpoint(), tmp_path / "real.ckpt")
    os.symlink(tmp_path / "real.ckpt", tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt") and liferaft.verify(str(tmp_path / "real.ckpt")).chunks
    io.remove_checkpoint(tmp_path / "real.ckpt")
    assert not os.path.exists(tmp_path / "real.ckpt")
    io.remove_checkpoint(tmp_path / "gone.ckpt")            # (nothing there: nothing to do, as Lightning's own)


def test_what_the_plugin_cannot_honour_is_refused(tmp_path):
    io = LiferaftCheckpointIO(async_save=False)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt", storage_options={"x": 1})
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    with pytest.raises(OptionsError, match="weights_only"):
        io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)
    with pytest.raises(OptionsError, match="dict"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location={"cuda:0": "cpu"})
    with pytest.raises(OptionsError, match="async_save"):
        LiferaftCheckpointIO(async_save="yes")                                       # type: ignore[arg-type]
    with pytest.raises(OptionsError, match="SaveOptions"):
        LiferaftCheckpointIO(options={"compression": "zstd"})                        # type: ignore[arg-type]


def test_import_liferaft_imports_no_framework():
    code = ("import sys, liferaft, liferaft.integrations; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torchtitan')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_async_a_new_checkpoint_appears_only_once_committed_and_what_lightning_drops_goes_after(tmp_path):
    """async_save=True: a new path holds nothing until its save commits (written under a temporary name, renamed
    into place), and a checkpoint Lightning drops while a save is in flight is removed only once that save committed
    (an older checkpoint never goes before a newer one exists)."""
    io = LiferaftCheckpointIO(async_save=True)
    old, new = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    io.save_checkpoint(_checkpoint(), old)
    io.wait()
    big = {**_checkpoint(), "blob": torch.randn(8 << 20)}              # (32 MiB: the save takes a while)
    io.save_checkpoint(big, new)
    io.remove_checkpoint(old)                                           # ModelCheckpoint drops the old one at once
    assert liferaft.verify(str(old)).chunks > 0                         # still there: the new one is not committed
    assert not os.path.exists(new) or liferaft.verify(str(new)).chunks  # absent, or whole
    io.teardown()
    assert not os.path.exists(old) and torch.equal(io.load_checkpoint(new)["blob"], big["blob"])
    assert [n for n in os.listdir(tmp_path)] == ["epoch=1.ckpt"]        # (no temporary left)


def test_async_a_save_still_in_flight_at_exit_is_finished(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` (teardown has run) and then the end of the script: the plugin waits
    for the save at the interpreter's exit."""
    code = (f"import torch, liferaft\nfrom liferaft.integrations.lightning import LiferaftCheckpointIO\n"
            f"io = LiferaftCheckpointIO(async_save=True)\n"
            f"io.save_checkpoint({{'w': torch.randn(8 << 20), 'epoch': 1}}, {str(tmp_path / 'final.ckpt')!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert liferaft.verify(str(tmp_path / "final.ckpt")).chunks > 0


def test_remove_checkpoint_on_s3(s3_server, monkeypatch):
    import uuid

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}/epoch=0.ckpt"
    io = LiferaftCheckpointIO()
    io.save_checkpoint(_checkpoint(), url)
    assert io.load_checkpoint(url)["epoch"] == 3
    io.remove_checkpoint(url)
    from liferaft.storage import resolve

    assert resolve(url).list() == []
