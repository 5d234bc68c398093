"""The fuzzing suite (tests/fuzz) with the small derandomized budget of ``make test``, in a child process under
its memory limit (tests/fuzz/run.py) and a wall-clock limit: a hang, an allocation bomb or any broken promise of
docs/SECURITY.md fails this test with the suite's report. ``make fuzz`` runs the same suite far longer."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fuzz_suite_bounded_budget():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fuzz", "run.py"), "--examples", "8",
                           "--call-timeout", "10"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"the fuzzing suite failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
