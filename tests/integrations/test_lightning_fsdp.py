"""liferaft behind Lightning's sharded training: ``LiferaftModelParallelStrategy`` (FSDP2 through
``ModelParallelStrategy``) under torchrun on 2 processes (gloo, CPU), ``ModelCheckpoint`` every epoch, rank 0 killed
with SIGKILL in epoch 2; ``fit(ckpt_path="last")`` on 2 processes starts from the gathered parameters and AdamW
state bitwise those at the end of epoch 1 and redoes the lost steps with the same losses bit for bit; on 1 process
the shards reshard onto one rank, bitwise the same. In one process: the options it refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import liferaft
from liferaft.errors import OptionsError
from liferaft.integrations.lightning import LiferaftModelParallelStrategy

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_fsdp_job.py")
KILL_AT = 10                # global step: epoch 2's second batch on 2 ranks (4 batches per epoch)


def _fit(out: str, world: int, kill_at: int, resume: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "PL_"))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), JOB, out, os.path.join(out, "ck"), str(kill_at), resume],
                          capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})


def _rows(out: str, name: str, run: str) -> list[dict]:
    with open(os.path.join(out, name)) as f:
        return [r for r in map(json.loads, f) if r["run"] == run]


def test_fsdp2_fit_killed_resumes_bitwise_on_2_and_reshards_onto_1(tmp_path):
    first = str(tmp_path / "first")
    os.makedirs(first)
    done = _fit(first, 2, KILL_AT, "none")
    assert done.returncode != 0                                  # (killed)
    ck = os.path.join(first, "ck")
    assert sorted(os.listdir(ck)) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert liferaft.verify(os.path.join(ck, "last.ckpt")).chunks > 0
    info = liferaft.inspect(os.path.join(ck, "last.ckpt"))
    assert info.world_size == 2 and any(t.key.startswith("optimizer_states.0.") for t in info.tensors)
    killed = {r["step"]: r["loss"] for r in _rows(first, "steps.jsonl", "none-2")}
    at_epoch_1 = next(r["digest"] for r in _rows(first, "digests.jsonl", "none-2") if r["step"] == 8)
    for world in (2, 1):
        out = str(tmp_path / f"on{world}")
        shutil.copytree(first, out)
        done = _fit(out, world, -1, "last")
        assert done.returncode == 0, done.stderr[-4000:]
        start = _rows(out, "digests.jsonl", f"last-{world}")[0]
        assert start["at"] == "start" and start["step"] == 8 and start["digest"] == at_epoch_1
        if world == 2:
            again = {r["step"]: r["loss"] for r in _rows(out, "steps.jsonl", "last-2")}
            assert all(again[s] == killed[s] for s in (9, 10)), (again, killed)


def test_options_it_cannot_honour_are_refused():
    with pytest.raises(OptionsError, match="save_distributed_checkpoint"):
        LiferaftModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(OptionsError, match="SaveOptions"):
        LiferaftModelParallelStrategy(options={"overwrite": True})  # type: ignore[arg-type]


@pytest.fixture
def no_process_group_after():
    """The strategy sets up a process group (of one) in this process: torn down after the test."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_plugin_and_the_strategy_refuse_each_others_checkpoints(tmp_path, no_process_group_after):
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from liferaft.integrations.lightning import LiferaftCheckpointIO

    sys.path.insert(0, os.path.dirname(JOB))
    from _lightning_fsdp_job import Model

    class Plain(Model):                                           # (the same module, unsharded: for the plugin)
        def configure_model(self):
            pass

    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)
    common = {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False}

    def strategy():
        return LiferaftModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1,
                                             process_group_backend="gloo")

    L.Trainer(plugins=[LiferaftCheckpointIO()], callbacks=[ModelCheckpoint(tmp_path / "plugin", save_last=True)],
              **common).fit(Plain(), data)
    L.Trainer(strategy=strategy(), callbacks=[ModelCheckpoint(tmp_path / "strategy", save_last=True)],
              **common).fit(Model(), data)
    with pytest.raises(OptionsError, match="not saved by LiferaftModelParallelStrategy.*nothing was loaded"):
        L.Trainer(strategy=strategy(), **{**common, "max_epochs": 2}).fit(
            Model(), data, ckpt_path=str(tmp_path / "plugin" / "last.ckpt"))
    with pytest.raises(OptionsError, match="saved by LiferaftModelParallelStrategy.*nothing was loaded"):
        L.Trainer(plugins=[LiferaftCheckpointIO()], **{**common, "max_epochs": 2}).fit(
            Plain(), data, ckpt_path=str(tmp_path / "strategy" / "last.ckpt"))
