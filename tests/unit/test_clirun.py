"""tests/clirun.py's ``liferaft_cli`` (the CLI forked from a server that imported it once) answers as the real
``python -m liferaft`` does: the same stdout, stderr and exit status, the caller's environment and working
directory, a hang killed at the timeout."""

import os
import subprocess
import sys

import pytest
import torch
from clirun import liferaft_cli

import liferaft


def _real(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "liferaft", *args], capture_output=True, text=True, timeout=120,
                          **kw)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("clirun") / "ck")
    liferaft.save(path, {"w": torch.arange(6.0).reshape(2, 3), "step": 3})
    return path


@pytest.mark.parametrize("args", [("inspect", "{ck}"), ("read", "--json", "{ck}"), ("verify", "{ck}"),
                                  ("inspect", "{ck}/nope"), ("verify", "--no-such-flag"), ("--help",), ()])
def test_the_forked_command_answers_as_python_dash_m_liferaft(ck, args):
    argv = [a.format(ck=ck) for a in args]
    fast, real = liferaft_cli(*argv), _real(*argv)
    assert (fast.returncode, fast.stdout, fast.stderr) == (real.returncode, real.stdout, real.stderr)


def test_the_callers_environment_and_working_directory(tmp_path, ck):
    os.symlink(ck, tmp_path / "here")
    env = {**os.environ, "COLUMNS": "40"}
    fast = liferaft_cli("inspect", "here", cwd=str(tmp_path), env=env)
    real = _real("inspect", "here", cwd=str(tmp_path), env=env)
    assert fast.returncode == real.returncode and fast.stdout == real.stdout
    assert liferaft_cli("inspect", "here").returncode != 0             # (not found from this directory)


def test_a_command_past_its_timeout_is_killed(ck):
    with pytest.raises(subprocess.TimeoutExpired):
        liferaft_cli("inspect", ck, timeout=0.001)
