"""benchmarks/gpu_check.sh's refusal without a GPU says what it does (regression: it said it ran on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --require-gpu runs the checks")
def test_require_gpu_without_a_gpu_exits_3_and_says_nothing_is_checked():
    out = subprocess.run(["sh", str(SCRIPT), "--require-gpu"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 3, out.stderr
    said = out.stdout + out.stderr
    assert "NO GPU PRESENT" in said and "status 3" in said and "on the CPU" not in said
