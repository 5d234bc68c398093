"""The benchmark's --quick mode runs end to end: every method's checkpoint is verified bit-exact inside it.

Correctness only (the benchmark aborts on a wrong load); no timing is asserted here.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_async_quick_runs_and_verifies(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_async.py"), "--quick",
                          "--methods", "liferaft-blocking,liferaft-overlapped,dcp-sync"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "liferaft async_save, blocking staging" in out.stdout
    assert out.stderr.count("(verified)") == 3          # one line per method and rep, printed after verification


def test_bench_write_less_quick_runs_and_verifies(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_write_less.py"), "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BENCH_TMP": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    for regime in ("full", "crumbs", "frozen90", "lora"):  # each table is printed after every load was checked
        assert f"| {regime}: method |" in out.stdout
        assert f"| {regime}: keep_last=2 |" in out.stdout      # and after every manager restore was checked
    assert out.stdout.count("| liferaft incremental |") == 4
    crumbs = out.stdout.split("| crumbs: keep_last=2 |")[1].split("\n\n")[0]
    default = next(line for line in crumbs.splitlines() if line.startswith("| default"))
    assert default.split("|")[4].strip() == "2, 2"      # crumbs do not keep a third step on disk (median, max)
    assert "| unchanged share |" in out.stdout


def test_bench_tiers_small_runs_and_verifies():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tiers.py"), "--size-gib", "0.02",
                          "--reps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for label in ("memory, own node", "memory, peer (node lost)", "local disk", "S3 (moto)", "MemoryTier.save"):
        assert f"| {label}" in out.stdout           # printed only after every restore was checked bit-exact


def test_bench_convert_small_runs_and_checks_round_trips(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_convert.py"), "--size-gib", "0.07"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BENCH_TMP": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    for fmt in ("HF safetensors", "DCP", "torch.save"):   # the table is printed only after every round trip
        assert f"| liferaft: liferaft → {fmt} |" in out.stdout and f"| liferaft: {fmt} → liferaft |" in out.stdout
    assert "| DCP → torch.save (dcp_to_torch_save) |" in out.stdout


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


def test_bench_readpath_small_runs_and_verifies():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_readpath.py"), "--size-mib", "64",
                          "--reps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for label in ("liferaft, default (the probe's path)", "liferaft, O_DIRECT forced", "liferaft, page cache forced",
                  "DCP"):
        assert f"| {label} |" in out.stdout         # printed only after every load was checked bit-exact
    assert out.stdout.count("rank ") == 2


def test_bench_many_small_runs_and_verifies(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_many.py"), "--keys", "300",
                          "--reps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BENCH_TMP": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    for label in ("liferaft", "DCP", "torch.save / torch.load"):     # printed only after every load was checked
        assert f"| {label} |" in out.stdout
