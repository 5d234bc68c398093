"""examples/train_gpt.py under torchrun: train on 2 ranks (FSDP2), resume on 3 ranks (DDP) from the newest step."""

from __future__ import annotations

import os
import subprocess
import sys

import liferaft
from liferaft.testing.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(nproc: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), os.path.join(ROOT, "examples", "train_gpt.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_train_then_resume_on_another_layout(tmp_path):
    root = str(tmp_path / "run")
    first = _torchrun(2, "--root", root, "--steps", "12", "--every", "5")
    assert "starting on 2 rank(s), layout fsdp" in first
    second = _torchrun(3, "--root", root, "--steps", "20", "--every", "5", "--layout", "ddp")
    assert "resumed from step 11 on 3 rank(s), layout ddp" in second      # last_step=11 was saved
    assert liferaft.inspect(os.path.join(root, "step-0000000019")).metadata["step"] == 19
