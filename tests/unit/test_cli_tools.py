"""`liferaft ls`, `gc`, `diff` and `verify --json`, run as the real command in a subprocess, and the library
public functions behind them (``liferaft.ls``, ``gc``, ``diff``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft import CheckpointManager, JobOptions, diff, gc, ls


def run(*args: str) -> subprocess.CompletedProcess:
    return liferaft_cli(*args, timeout=120)


@pytest.fixture
def root(tmp_path):
    """A manager root with steps 0-4: a frozen 4 MiB tensor (so later steps reference step 0) and a moving one."""
    path = str(tmp_path / "run")
    state = {"frozen": torch.randn(1024, 1024), "w": torch.zeros(64, 64), "step": 0}
    with CheckpointManager(path, every_steps=1, async_save=False, job=JobOptions(job_id="job-x")) as mgr:
        for step in range(5):
            state["w"] += 1
            state["step"] = step
            mgr.maybe_save(step, state, metrics={"loss": 5.0 - step})
    return path


def test_ls_lists_status_size_writer_and_references(root):
    steps = ls(root)
    assert [i.step for i in steps] == [0, 1, 2, 3, 4] and all(i.status == "committed" for i in steps)
    assert steps[0].nbytes > 4 << 20 and steps[3].depends_on == (0,) and steps[3].job_id == "job-x"
    out = run("ls", root)
    assert out.returncode == 0 and "refs 0" in out.stdout and "job-x" in out.stdout
    doc = json.loads(run("ls", root, "--json").stdout)
    assert [d["step"] for d in doc] == [0, 1, 2, 3, 4] and doc[4]["depends_on"] == [0]


def test_ls_shows_incomplete_and_corrupt_steps(root):
    os.remove(os.path.join(root, "step-0000000004", "COMMIT"))
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "step-0000000003")) for f in fs
            if f.endswith(".bin")]
    with open(data[0], "r+b") as f:
        f.truncate(10)
    doc = {d["step"]: d for d in json.loads(run("ls", root, "--json").stdout)}
    assert doc[4]["status"] == "incomplete" and doc[3]["status"] == "corrupt" and "truncated" in doc[3]["reason"]


def test_gc_keeps_what_is_referenced_and_dry_run_deletes_nothing(root):
    out = run("gc", root, "--keep-last", "1", "--dry-run", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["deleted"] == [1, 2, 3]     # 0: referenced by 4
    assert [i.step for i in ls(root)] == [0, 1, 2, 3, 4]
    r = gc(root, keep_last=1)
    assert r.deleted == (1, 2, 3) and r.kept == (0, 4) and r.freed_bytes > 0
    assert [i.step for i in ls(root)] == [0, 4]
    got = {"frozen": torch.zeros(1024, 1024), "w": torch.zeros(64, 64), "step": -1}
    liferaft.load(os.path.join(root, "step-0000000004"), got)
    assert got["step"] == 4 and float(got["w"][0, 0]) == 5.0


def test_gc_refuses_while_a_job_holds_the_root(tmp_path):
    path = str(tmp_path / "run")
    # (a lease of 5 s: gc watches a live holder's lease for its ttl before refusing, 30 s by default)
    with CheckpointManager(path, every_steps=1, async_save=False, job=JobOptions(lease_ttl=5.0)) as mgr:
        mgr.maybe_save(0, {"w": torch.ones(3)})
        out = run("gc", path, "--keep-last", "1")
        lines = out.stderr.strip().splitlines()         # why it waits (at once), then the one error line
        assert out.returncode == 1 and len(lines) == 2 and "waiting up to 5 s" in lines[0] and "error" in lines[1]


def test_diff_finds_changed_added_removed_and_accepts_a_tolerance(tmp_path):
    a = {"same": torch.arange(10.0), "moved": torch.ones(100, 10), "gone": torch.zeros(2), "lr": 0.1}
    b = {"same": torch.arange(10.0), "moved": torch.ones(100, 10), "new": torch.zeros(2), "lr": 0.2}
    b["moved"][50, 3] += 1e-3
    liferaft.save(str(tmp_path / "a"), a)
    liferaft.save(str(tmp_path / "b"), b)
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"), slab_bytes=1024)          # several slabs per tensor
    status = {k.key: k.status for k in r.keys}
    assert status == {"same": "equal", "moved": "changed", "gone": "removed", "new": "added", "lr": "changed"}
    moved = next(k for k in r.keys if k.key == "moved")
    assert moved.max_abs == pytest.approx(1e-3, rel=1e-3) and moved.max_rel == pytest.approx(1e-3, rel=1e-3)
    out = run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--key", "moved", "--tolerance", "0.01")
    assert out.returncode == 0 and "identical" in out.stdout
    out = run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["identical"] is False


def test_diff_of_a_resume_across_layouts_is_exact(tmp_path):
    full = torch.randn(64, 32)
    liferaft.save(str(tmp_path / "a"), {"w": full})
    liferaft.save(str(tmp_path / "b"), {"w": full}, options=liferaft.SaveOptions(chunk_bytes=1 << 16,
                                                                                 compression="on"))
    assert diff(str(tmp_path / "a"), str(tmp_path / "b")).identical
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "b")).returncode == 0


def test_verify_json_and_every_fault_named(tmp_path):
    path = str(tmp_path / "c")
    liferaft.save(path, {"a": torch.randn(300, 300), "b": torch.randn(300, 300)})
    assert json.loads(run("verify", path, "--json").stdout)["ok"] is True
    for d, _, fs in os.walk(path):
        for f in fs:
            if f.endswith(".bin"):
                with open(os.path.join(d, f), "r+b") as fh:
                    fh.seek(4096)                      # (inside a)
                    fh.write(b"\xff\xff")
                    fh.seek(300 * 300 * 4 + 8192)      # (inside b, wherever its chunk starts)
                    fh.write(b"\xff\xff")
    out = run("verify", path)
    assert out.returncode == 1 and "'a'" in out.stdout and "'b'" in out.stdout and "2 fault(s)" in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1
    doc = json.loads(run("verify", path, "--json").stdout)
    assert doc["ok"] is False and len(doc["faults"]) == 2


def test_inspect_keys_with_streaming_stats(tmp_path):
    from liferaft.tools.stats import describe

    w = torch.arange(-500.0, 500.0).reshape(100, 10)
    w[3, 3] = float("nan")
    liferaft.save(str(tmp_path / "c"), {"model": {"w": w, "b": torch.ones(7)}, "opt": {"m": torch.zeros(3)}},
                  options=liferaft.SaveOptions(compression="on"))
    infos = describe(str(tmp_path / "c"), ["model.*"], stats=True, slab_bytes=512)     # many slabs
    by = {i.key: i for i in infos}
    assert set(by) == {"model.w", "model.b"} and by["model.w"].codecs == ("bytegroup-zstd",)
    st = by["model.w"].stats
    finite = w[~torch.isnan(w)].double()
    assert st["nan"] == 1 and st["min"] == -500.0 and st["max"] == 499.0
    assert st["mean"] == pytest.approx(float(finite.mean())) and st["std"] == pytest.approx(float(finite.std(
        unbiased=False)))
    out = run("inspect", str(tmp_path / "c"), "model.w", "--stats")
    assert out.returncode == 0 and "NaN 1" in out.stdout and "bytegroup-zstd" in out.stdout
    doc = json.loads(run("inspect", str(tmp_path / "c"), "--json").stdout)
    assert {d["key"] for d in doc} == {"model.w", "model.b", "opt.m"}


def test_progress_bar_only_on_a_terminal(tmp_path):
    from liferaft.cli.progress import Progress

    path = str(tmp_path / "c")
    liferaft.save(path, {"a": torch.randn(512, 512)})
    piped = run("verify", path)
    assert piped.returncode == 0 and piped.stderr == ""                 # piped: no bar
    seen = []
    with Progress(100, "x", enabled=False) as tick:
        tick(10)
    liferaft.verify(path, progress=seen.append)
    assert sum(seen) == 512 * 512 * 4
    import io

    from liferaft.cli import main

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    old = sys.stderr
    sys.stderr = term
    try:
        assert main(["verify", path]) == 0
    finally:
        sys.stderr = old
    bar = term.getvalue()
    assert "verify" in bar and "B/s" in bar                          # tqdm: bytes and rate
    sizes = []                                  # a bar's total, when it costs a pass over the manifest: only shown
    for enabled in (False, True):
        sys.stderr = Terminal()
        try:
            with Progress(lambda: sizes.append(enabled) or 100, "x", enabled=enabled) as tick:
                tick(10)
        finally:
            sys.stderr = old
    assert sizes == [True]


def test_read_and_plan_have_json_output(tmp_path):
    liferaft.save(str(tmp_path / "c"), {"w": torch.zeros(2, 3), "step": 4})
    doc = json.loads(run("read", str(tmp_path / "c"), "--json").stdout)
    assert {d["key"] for d in doc} == {"w", "step"}
    plans = json.loads(run("plan", "--json", "--gpus", "1000").stdout)
    assert len(plans) == 4 and all(0 <= p["goodput"] <= 1 for p in plans)   # the per-step plan by default


def test_plan_refuses_a_failure_rate_that_makes_the_interval_infinite(capsys):
    # 1e-320 (a denormal) gave an infinite Young/Daly interval, goodput 0.0 and JSON with Infinity (fuzzing)
    from liferaft.cli import main as cli_main

    assert cli_main(["plan", "--failures-per-gpu-hour", "1e-320"]) == 2
    assert "1e-12" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_ls_and_gc_of_a_root_that_is_not_a_folder_name_it(tmp_path, kind):
    path = str(tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/null", path)
    for call in (lambda: ls(path), lambda: gc(path, keep_last=1, dry_run=True)):
        with pytest.raises(liferaft.errors.OptionsError, match="not a folder"):
            call()
    for args in (("ls", path), ("gc", path, "--keep-last", "1", "--dry-run")):
        r = run(*args)
        assert r.returncode == 1 and "not a folder" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flag", ["--keep-last", "--keep-every", "--keep-best"])
def test_gc_with_a_count_of_zero_is_a_usage_error(root, flag):
    r = run("gc", root, flag, "0")
    assert r.returncode == 2 and "must be at least 1" in r.stderr, r.stderr
    assert len(ls(root)) == 5
