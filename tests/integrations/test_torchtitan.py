"""liferaft as torchtitan's checkpoint manager (``LiferaftCheckpointManager``), with torchtitan's own components.

Under torchrun (``_torchtitan_job.py``): FSDP2 on 2 processes (gloo, CPU), torchtitan's ``OptimizersContainer``,
``LRSchedulersContainer`` and ``ParallelAwareDataloader``, the manager built from its ``Config`` as torchtitan's
trainer builds it, async saves every 2 steps, rank 0 killed with SIGKILL after step 9. ``load()`` on 2 processes
picks the newest committed step (8) and step 9 is redone bit for bit (parameters, AdamW, the schedule and the data
position all restored); on 3 processes the load is refused before anything changes (the loader's position belongs
to 2 ranks), then, with ``exclude_from_loading=["dataloader"]``, the FSDP2 shards reshard onto 3 ranks bitwise.

In one process: the config's refusals, ``initial_load_path`` from a PyTorch DCP folder (torchtitan's own format),
the seed checkpoint (step 0: the model alone), ``keep_latest_k``, a final model-only save in ``export_dtype``, and
a step that was never committed not picked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

import liferaft
from liferaft.errors import CheckpointNotFoundError, OptionsError, StateMismatchError
from liferaft.integrations.torchtitan import LiferaftCheckpointManager

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torchtitan_job.py")


def _run(out: str, world: int, mode: str, expect_ok: bool = True) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), JOB, out, mode], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert (done.returncode == 0) == expect_ok, done.stderr[-4000:]


def _records(out: str, name: str) -> list[dict]:
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


def test_killed_fsdp2_job_resumes_bitwise_and_reshards_onto_3_processes(tmp_path):
    first = str(tmp_path / "first")
    os.makedirs(first)
    _run(first, 2, "train", expect_ok=False)
    killed = {r["step"]: r["loss"] for r in _records(first, "losses.jsonl")}
    assert sorted(killed) == list(range(1, 10))
    assert sorted(os.listdir(os.path.join(first, "checkpoint"))) == ["step-6", "step-8"]      # keep_latest_k=2
    assert liferaft.verify(os.path.join(first, "checkpoint", "step-8")).chunks > 0
    saved8 = _records(first, "saved-8.json")[-1]["digest"]

    again, resharded = str(tmp_path / "again"), str(tmp_path / "resharded")
    shutil.copytree(first, again)
    shutil.copytree(first, resharded)
    _run(again, 2, "resume")
    assert _records(again, "loaded-2.json") == [{"step": 8, "digest": saved8}]
    redone = {r["step"]: r["loss"] for r in _records(again, "losses.jsonl") if r["mode"] == "resume"}
    assert sorted(redone) == [9, 10] and redone[9] == killed[9], (redone, killed)
    assert sorted(os.listdir(os.path.join(again, "checkpoint"))) == ["step-10", "step-6", "step-8"]  # (no purge
    #                                                                    at the final save, as torchtitan's own)

    _run(resharded, 3, "reshard")
    refused = _records(resharded, "refused.json")[0]
    assert "data-parallel size of 2" in refused["error"] and "exclude_from_loading" in refused["error"]
    assert refused["unchanged"]
    assert _records(resharded, "loaded-3.json") == [{"step": 8, "digest": saved8}]
    assert sorted(r["step"] for r in _records(resharded, "losses.jsonl") if r["mode"] == "reshard") == [9, 10]


# -- one process ---------------------------------------------------------------------------------------------------

def _parts(seed: int = 0):
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opts = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opts, training_steps=10)
    return model, opts, scheds


class _Train:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _manager(base, model, opts, scheds, train, **kw):
    config = LiferaftCheckpointManager.Config(enable=True, folder="ck", interval=1, **kw)
    return config.build(dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                        states={"train_state": train}, sd_adapter=None, base_folder=str(base))


def _step(model, opts, scheds) -> None:
    model(torch.randn(3, 4)).square().mean().backward()
    opts.step()
    scheds.step()
    opts.zero_grad()


def test_config_refusals():
    with pytest.raises(OptionsError, match="Hugging Face"):
        LiferaftCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(OptionsError, match="local or shared"):
        LiferaftCheckpointManager.Config(enable=True, folder="s3://bucket/ck")
    with pytest.raises(ValueError, match="at least 2"):             # torchtitan's own checks still run
        LiferaftCheckpointManager.Config(enable=True, keep_latest_k=1)


def test_initial_load_from_dcp_seed_step_retention_and_last_model_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    src, _, _ = _parts(seed=1)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path / "pretrained"))        # torchtitan's own format
    model, opts, scheds = _parts()
    train = _Train()
    m = _manager(tmp_path, model, opts, scheds, train, initial_load_path=str(tmp_path / "pretrained"),
                 keep_latest_k=3, last_save_model_only=True, export_dtype="bfloat16")
    assert m.load() is True                                        # nothing in ck: the initial load, model only
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values()))
    assert not opts.optimizers[0].state
    for step in range(1, 6):
        _step(model, opts, scheds)
        train.step = step
        assert m.save(step, last_step=step == 5)
    m.close()
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck)) == ["step-2", "step-3", "step-4", "step-5"]   # keep_latest_k=3 + the final one
    last = liferaft.read(str(ck / "step-5"))
    assert set(last) == {"model"} and all(v.dtype == torch.bfloat16 for v in last["model"].values())

    shutil.rmtree(ck / "step-5")
    os.remove(ck / "step-4" / "COMMIT")                            # as a save killed before its commit
    fresh, fopts, fscheds = _parts(seed=2)
    ftrain = _Train()
    m2 = _manager(tmp_path, fresh, fopts, fscheds, ftrain)
    assert m2.load() is True and ftrain.step == 3                  # the newest committed step
    saved = liferaft.read(str(ck / "step-3"))
    assert all(torch.equal(v, saved["model"][k]) for k, v in fresh.state_dict().items())
    assert fscheds.state_dict() == {"last_epoch": 3}
    with pytest.raises(CheckpointNotFoundError, match="load_step=7"):
        m2.load(step=7)
    for step in (4, 5):                                            # over the leftovers of step 4
        _step(fresh, fopts, fscheds)
        assert m2.save(step)
    m2.close()
    again, aopts, ascheds = _parts(seed=5)                         # back to step 3, then step 4 saved again
    m3 = _manager(tmp_path, again, aopts, ascheds, _Train())
    assert m3.load(step=3)
    _step(again, aopts, ascheds)
    assert m3.save(4)
    m3.close()
    assert all(torch.equal(v, liferaft.read(str(ck / "step-4"))["model"][k]) for k, v in again.state_dict().items())

    seed_model, sopts, sscheds = _parts(seed=3)                     # step 0: the seed checkpoint, model only
    seed = _manager(tmp_path / "seed", seed_model, sopts, sscheds, _Train())
    assert seed.save(0)
    seed.close()
    assert set(liferaft.read(str(tmp_path / "seed" / "ck" / "step-0"))) == {"model", "optimizer", "lr_scheduler",
                                                                            "train_state"}
    other, oopts, oscheds = _parts(seed=4)
    assert _manager(tmp_path / "seed", other, oopts, oscheds, _Train()).load() is True
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), seed_model.state_dict().values()))
    assert not oopts.optimizers[0].state


def test_initial_model_load_with_a_missing_key_changes_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    src, _, _ = _parts(seed=1)
    dcp.save({"0.weight": src[0].weight.detach()}, checkpoint_id=str(tmp_path / "partial"))
    model, opts, scheds = _parts()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = _manager(tmp_path, model, opts, scheds, _Train(), initial_load_path=str(tmp_path / "partial"))
    with pytest.raises(StateMismatchError, match=r"'0.bias'.*nothing was loaded"):
        m.load()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_exclusions_stay_strict_foreign_steps_are_refused_and_odd_names_ignored(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opts, scheds = _parts()
    train = _Train()
    m = _manager(tmp_path, model, opts, scheds, train)
    _step(model, opts, scheds)
    train.step = 1
    assert m.save(1)
    m.close()
    # a model with one more parameter than the checkpoint: refused even with an exclusion (only it is lenient)
    bigger = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2))
    _, bopts, bscheds = _parts()
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    bopts = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[bigger])
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    excl = _manager(tmp_path, bigger, bopts, bscheds, _Train(), exclude_from_loading=["train_state"])
    with pytest.raises(StateMismatchError, match=r"model\.2\.weight"):
        excl.load()
    assert all(torch.equal(before[k], v) for k, v in bigger.state_dict().items())
    # the exclusion itself: train_state not loaded, the rest is
    fresh, fopts, fscheds = _parts(seed=9)
    ftrain = _Train()
    assert _manager(tmp_path, fresh, fopts, fscheds, ftrain, exclude_from_loading=["train_state"]).load()
    assert ftrain.step == 0 and all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                                        model.state_dict().values()))
    # a name torchtitan never makes is not a step; a DCP step (torchtitan's own manager's) newer than the newest
    # liferaft step is refused with what to do
    shutil.copytree(tmp_path / "ck" / "step-1", tmp_path / "ck" / "step-07")
    other, oopts, oscheds = _parts(seed=3)
    otrain = _Train()
    assert _manager(tmp_path, other, oopts, oscheds, otrain).load() and otrain.step == 1
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ck" / "step-5"))
    with pytest.raises(OptionsError, match=r"DCP steps newer.*step-5.*initial_load_path"):
        _manager(tmp_path, other, oopts, oscheds, otrain).load()
