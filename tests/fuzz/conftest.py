"""The fuzzing suite's settings and seed inputs. It runs only through tests/unit/test_fuzz.py (a child process
with a memory and time limit, a small derandomized budget) and ``make fuzz`` (a large randomized one); ``pytest
tests`` does not collect it (``norecursedirs`` in pyproject.toml).

Environment (read here only): ``LIFERAFT_FUZZ_EXAMPLES`` examples per target (default 6), ``LIFERAFT_FUZZ_RANDOM``
("1": a fresh random seed per run, else derandomized), ``LIFERAFT_FUZZ_CALL_TIMEOUT`` seconds per call (30).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import liferaft

EXAMPLES = int(os.environ.get("LIFERAFT_FUZZ_EXAMPLES", "6"))
RANDOM = os.environ.get("LIFERAFT_FUZZ_RANDOM", "") == "1"
CALL_TIMEOUT = int(os.environ.get("LIFERAFT_FUZZ_CALL_TIMEOUT", "30"))

settings.register_profile(
    "liferaft-fuzz", max_examples=EXAMPLES, derandomize=not RANDOM, deadline=None, database=None,
    print_blob=True, report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if RANDOM else [])], suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
settings.load_profile("liferaft-fuzz")

GOLDEN_V3 = Path(__file__).resolve().parent.parent / "golden" / "v3"


@dataclass(frozen=True)
class Seed:
    """One untouched input: where it lies (``path`` under ``base``, the folder copied per example), its format
    and what reading it gives."""

    base: str
    rel: str
    fmt: str
    expected: Any

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:   # hypothesis prints the fixtures of a failing example
        p.text(f"Seed({self.fmt}: {self.rel})")

    @property
    def path(self) -> str:
        return os.path.join(self.base, self.rel)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(16)
    return {"model": {"w": torch.randn(48, 33, generator=g), "b": torch.arange(10, dtype=torch.int64),
                      "h": torch.randn(300, generator=g).to(torch.float16),
                      "bf": torch.randn(17, generator=g).to(torch.bfloat16), "m": torch.tensor([True, False, True]),
                      "u": torch.arange(20, dtype=torch.uint8)},
            "q": {"x": torch.randn(40, 40, generator=g)},
            "meta": {"step": 3, "name": "run", "lr": [0.1, 1e-3], "nested": {"a": (1, 2), "b": None, "f": 2.5}}}


@pytest.fixture(scope="session")
def seeds() -> dict[str, Seed]:
    """The seed inputs, made once per session in a temporary folder (removed after)."""
    top = tempfile.mkdtemp(prefix="liferaft-fuzz-seeds-")
    made: dict[str, Seed] = {}
    root = os.path.join(top, "native")
    state = _state()
    opts = dict(compression="on", quantize=("q.*",))
    liferaft.save(os.path.join(root, "step-0000000001"), state, options=liferaft.SaveOptions(**opts))
    state["model"]["b"] += 1
    liferaft.save(os.path.join(root, "step-0000000002"), state, options=liferaft.SaveOptions(
        **opts, incremental_base="step-0000000001", reference_min_share=0))
    for name, rel in (("native", "step-0000000002"), ("native-base", "step-0000000001")):
        made[name] = Seed(root, rel, "liferaft", liferaft.read(os.path.join(root, rel)))
    perrank = os.path.join(top, "perrank")
    shutil.copytree(GOLDEN_V3, os.path.join(perrank, "ck"))
    made["perrank"] = Seed(perrank, "ck", "liferaft", liferaft.read(os.path.join(perrank, "ck")))
    src = made["native-base"].path
    st_file = os.path.join(top, "st-file")
    liferaft.convert(src, os.path.join(st_file, "model.safetensors"), "safetensors", keys=["model"])
    made["st-file"] = Seed(st_file, "model.safetensors", "safetensors",
                           liferaft.read(os.path.join(st_file, "model.safetensors")))
    st_dir = os.path.join(top, "st-dir")
    liferaft.convert(src, os.path.join(st_dir, "m"), "safetensors", keys=["model"], max_shard_bytes=4096)
    made["st-dir"] = Seed(st_dir, "m", "safetensors", liferaft.read(os.path.join(st_dir, "m")))
    dcp = os.path.join(top, "dcp")
    liferaft.convert(src, os.path.join(dcp, "d"), "dcp")
    made["dcp"] = Seed(dcp, "d", "dcp", liferaft.read(os.path.join(dcp, "d")))
    pt = os.path.join(top, "pt")
    os.makedirs(pt)
    flat_state = {"model": dict(state["model"]), "q": dict(state["q"]), "step": 3}
    torch.save(flat_state, os.path.join(pt, "m.pt"))
    made["torch"] = Seed(pt, "m.pt", "torch", liferaft.read(os.path.join(pt, "m.pt")))
    yield made
    shutil.rmtree(top, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore::UserWarning")       # lossy loads warn, by design


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fuzz process's address space at the end (it runs under RLIMIT_AS: tests/fuzz/run.py)."""
    try:
        with open("/proc/self/status") as f:
            vm = [line.split(":")[1].strip() for line in f if line.startswith(("VmPeak", "VmSize", "VmHWM"))]
        terminalreporter.write_line(f"fuzz process memory: VmPeak {vm[0]}, VmSize {vm[1]}, VmHWM (RSS peak) {vm[2]}")
    except (OSError, IndexError):
        pass


@pytest.fixture(scope="session")
def call_timeout() -> int:
    return CALL_TIMEOUT
