"""The benchmark's --quick mode runs end to end: every method's checkpoint is verified bit-exact inside it.

Correctness only (the benchmark aborts on a wrong load); no timing is asserted here.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
