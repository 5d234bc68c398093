"""benchmarks/bench_compressed_save.py runs end to end on a tiny state: every method saves, every checkpoint loads
bit-exact (the script exits non-zero otherwise), and the table and the JSON lines name every row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compressed_save.py"


def test_compressed_save_benchmark_runs_and_checks_its_loads(tmp_path):
    jsonl = tmp_path / "out.jsonl"
    out = subprocess.run([sys.executable, str(SCRIPT), "--size-mib", "4", "--tensor-mib", "1", "--reps", "1",
                          "--dir", str(tmp_path), "--jsonl", str(jsonl)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("save liferaft zstd", "save DCP zstd", "encode only", "write limit", "load liferaft zstd",
                "load DCP raw", "Pipelining"):
        assert row in out.stdout, row
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["what"] for r in rows} >= {"save liferaft zstd", "save liferaft raw", "save DCP zstd", "save DCP raw",
                                          "encode only", "write limit", "load liferaft zstd", "load DCP zstd"}
    zstd = next(r for r in rows if r["what"] == "save liferaft zstd")
    assert 0 < zstd["stored"] < zstd["bytes"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-compressed-")] == []     # cleaned up
