"""The async-save and write-less benchmarks' --quick modes run end to end: every checkpoint is verified bit-exact
inside them.

Apart from the other benchmark smoke runs so that the test workers (``--dist loadfile``) run them side by
side. Correctness only; no timing is asserted here.
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
