"""The per-step benchmark (bench_steps.py --quick) runs end to end: timed runs, kill -9, restart, resume.

Apart from the other benchmark smoke runs so that the test workers (``--dist loadfile``) run them side by
side. Correctness only; no timing is asserted here.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_steps_quick_runs_kills_and_resumes(tmp_path):
    costs = tmp_path / "costs.json"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_steps.py"), "--quick", "--layouts",
                          "ddp", "--methods", "none,per-step,dcp", "--costs", str(costs)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| ddp | no checkpoints |" in out.stdout and "| ddp | DCP async_save, Young/Daly |" in out.stdout
    assert "How to reproduce" in out.stdout
    rows = {line.split("|")[2].strip(): line.split("|") for line in out.stdout.splitlines() if line.startswith("| ddp")}
    lost = -2                                     # the last column: steps lost
    for method in ("DCP async_save, Young/Daly",):
        assert int(rows[method][lost]) >= 0       # the run was killed, restarted and resumed (steps lost counted)
        assert float(rows[method][6]) > 0         # CPU per step (ms), measured
    import liferaft
    if hasattr(liferaft, "StepLogOptions"):       # the per-step mode: at most one step lost after kill -9
        assert int(rows["liferaft per-step (memory log + peer replica)"][lost]) <= 1
        assert "per_step" in costs.read_text()
