"""``ruff check`` (its default rules at the pinned minor version; pyproject.toml's per-file exceptions for tests,
benchmarks and examples) passes on the whole tree, so that ``make test`` fails when code drifts from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks", "examples"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{r.stdout}{r.stderr}"
