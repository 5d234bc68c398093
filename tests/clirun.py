"""The ``liferaft`` command line in a child process, without paying Python's and torch's start in every call.

``liferaft_cli(*args)`` behaves as ``subprocess.run([sys.executable, "-m", "liferaft", *args], capture_output=True,
text=True, timeout=...)``: a child process of its own (a hang is killed at ``timeout`` and raises
``subprocess.TimeoutExpired``; a crash is the child's, never the test's), stdout and stderr captured, the caller's
environment and working directory, the exit status ``liferaft.cli.main`` returns (or minus the signal that ended
it). The child is forked from a server process that imported ``liferaft.cli`` once (multiprocessing's forkserver,
one per test worker, the one ``liferaft.testing.run_ranks`` forks ranks from), so a call costs a fork instead of ~1.7 s of imports. Each child runs ``main(args)`` then
the atexit hooks, as ``python -m liferaft`` does. ``tests/unit/test_clirun.py`` checks it against the real
``python -m liferaft``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Any

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        from liferaft.testing.launcher import PRELOAD

        ctx = multiprocessing.get_context("forkserver")       # (one per process, shared with run_ranks' ranks:
        ctx.set_forkserver_preload([*PRELOAD, "liferaft.cli"])  # what they need preloaded too, whoever starts it)
        _CTX = ctx
    return _CTX


def _child(args: list[str], out: str, err: str, stdin: str, cwd: str, env: dict[str, str]) -> None:
    for path, fd, flags in ((stdin, 0, os.O_RDONLY), (out, 1, os.O_WRONLY), (err, 2, os.O_WRONLY)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [os.path.join(os.path.dirname(__file__), "liferaft"), *args]
    code = 1
    try:
        from liferaft.cli import main

        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, status 1
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 - a closed pipe: nothing more to say
                pass
        os._exit(code if isinstance(code, int) else 1)


def liferaft_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: str | None = None,
                 input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m liferaft *args`` in a child process (see the module's docstring)."""
    cmd = [sys.executable, "-m", "liferaft", *args]
    with tempfile.TemporaryDirectory(prefix="clirun-") as tmp:
        out, err, stdin = (os.path.join(tmp, n) for n in ("out", "err", "in"))
        for path, text in ((out, ""), (err, ""), (stdin, input or "")):
            with open(path, "w") as f:
                f.write(text)
        proc = _context().Process(target=_child, args=(list(args), out, err, stdin, cwd or os.getcwd(),
                                                       dict(os.environ if env is None else env)), daemon=False)
        proc.start()
        proc.join(timeout)
        killed = proc.is_alive()
        if killed:
            proc.kill()
            proc.join()

        def read(path: str) -> str:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()

        if killed:
            raise subprocess.TimeoutExpired(cmd, timeout, output=read(out), stderr=read(err))
        return subprocess.CompletedProcess(cmd, proc.exitcode, read(out), read(err))
