"""The property every fuzz target asserts, for every API call and CLI command on a mutated input: it returns the
saved data exactly (``strict``: the mutation is one liferaft must detect) or data of the shape the input declares
(``relaxed``: the mutation made another well-formed input, e.g. a re-sealed manifest naming another value), OR it
raises a :class:`liferaft.errors.LiferaftError` (the CLI: exit status 1, one line on stderr, no traceback); within
a time bound (``signal.alarm`` per call: :class:`CallTimeout`) and the memory bound of the process (RLIMIT_AS, set
by tests/unit/test_fuzz.py or ``make fuzz``: an allocation bomb is a ``MemoryError``, a failure); opening no file
outside the allowed folders (an audit hook records every ``open`` while a call runs); running nothing (the canary
of ``fuzz_canary`` never fires).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fuzz_canary
import torch

import liferaft
from liferaft.cli import main as cli_main
from liferaft.errors import LiferaftError


class CallTimeout(BaseException):  # not an Exception: liferaft must not be able to swallow it
    """A call ran past its time bound (raised by SIGALRM in the main thread)."""


# ------------------------------------------------------------------------------------------------- opened files

_GATE: list[list[str]] = []          # the open-recording of the call in progress (a hook cannot be removed)


def _audit(event: str, args: tuple) -> None:
    if not _GATE:
        return
    if event == "open":
        path, _mode, flags = args
        if isinstance(path, (str, bytes)):
            path = os.fsdecode(path)
            nofollow = isinstance(flags, int) and flags & os.O_NOFOLLOW
            _GATE[-1].append(("N" if nofollow else "F") + path)
    elif event in ("os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
        _GATE[-1].append("D" + os.fsdecode(args[0]))


sys.addaudithook(_audit)

_PYTHON_FILES = tuple({os.path.realpath(p) + os.sep for p in (
    sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    os.path.dirname(liferaft.__file__), os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(__file__)))})     # tests/: source lines of tracebacks and warnings
_SYSTEM = ("/dev/null", "/dev/urandom", "/proc/self/", f"/proc/{os.getpid()}/", "/sys/devices/system/cpu/",
           "/sys/fs/cgroup/", "/proc/cpuinfo", "/proc/meminfo", "/etc/localtime", "/usr/share/zoneinfo/")


def _where(record: str) -> str:
    """The file a recorded open reaches: links resolved except the last component of an O_NOFOLLOW open."""
    how, path = record[0], record[1:]
    if not os.path.isabs(path):
        return path                  # relative to a folder file descriptor opened (and recorded) before
    if how == "N":
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return os.path.realpath(path)


def outside(records: list[str], allowed: tuple[str, ...]) -> list[str]:
    """The recorded opens that reach a file outside ``allowed`` (folders) and Python's / torch's own files."""
    roots = tuple(os.path.realpath(a) for a in allowed)
    bad = []
    for r in records:
        where = _where(r)
        if not os.path.isabs(where):
            if ".." in where.split(os.sep):
                bad.append(r[1:])
            continue
        if any(where == a or where.startswith(a + os.sep) for a in roots):
            continue
        if where.startswith(_PYTHON_FILES) or where.startswith(_SYSTEM) or where in ("/dev/null", "/proc/self"):
            continue
        if r[0] == "D" and where in {os.path.realpath(p or ".") for p in sys.path}:
            continue                 # the import system lists the folders of sys.path (a lazy import)
        bad.append(f"{r[1:]} -> {where}" if where != r[1:] else where)
    return bad


# ------------------------------------------------------------------------------------------------------ one call


@dataclass
class Outcome:
    """What one call did: ``ok`` with its ``value``, or the LiferaftError it raised."""

    name: str
    ok: bool
    value: Any = None
    error: BaseException | None = None


@dataclass
class Bounds:
    """Per-call limits and the folders a call may open files in."""

    timeout: int
    allowed: tuple[str, ...]
    failures: list[str] = field(default_factory=list)


def _alarm(signum: int, frame: Any) -> None:
    raise CallTimeout()


@contextlib.contextmanager
def _recording(bounds: Bounds, name: str) -> Iterator[None]:
    records: list[str] = []
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(bounds.timeout)
    _GATE.append(records)
    try:
        yield
    finally:
        _GATE.pop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        bad = outside(records, bounds.allowed)
        if bad:
            bounds.failures.append(f"{name}: opened files outside the checkpoint: {bad[:5]}")


def _origin(e: BaseException) -> str:
    """Where ``e`` was raised: the innermost frames inside liferaft."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}liferaft{os.sep}" in f.filename]
    return " < ".join(f"{f.filename.rsplit(os.sep + 'liferaft' + os.sep, 1)[-1]}:{f.lineno}" for f in frames[::-1][:3])


def _abort(bounds: Bounds) -> None:
    """A hang or an allocation bomb: the example stops here (the next calls would likely do the same)."""
    raise AssertionError("\n".join(bounds.failures))


def call(bounds: Bounds, name: str, fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` under the bounds: its value, or the LiferaftError it raised; anything else is a failure
    recorded in ``bounds.failures`` (the test reports them all at the end of the example)."""
    try:
        with _recording(bounds, name):
            return Outcome(name, True, fn())
    except LiferaftError as e:
        if not str(e).strip():
            bounds.failures.append(f"{name}: {type(e).__name__} with an empty message")
        return Outcome(name, False, error=e)
    except CallTimeout:
        bounds.failures.append(f"{name}: no answer within {bounds.timeout} s")
        _abort(bounds)
    except MemoryError:
        bounds.failures.append(f"{name}: MemoryError (an allocation beyond the fuzz process's memory limit)")
        _abort(bounds)
    except RecursionError as e:
        bounds.failures.append(f"{name}: raw RecursionError: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001 (any other exception is the failure being looked for)
        bounds.failures.append(f"{name}: raw {type(e).__name__}: {str(e)[:300]} (at {_origin(e)})")
    return Outcome(name, False, error=None)


def run_cli(bounds: Bounds, argv: list[str]) -> tuple[int, str, str]:
    """``liferaft ARGV`` in this process (stdout, stderr captured): a traceback, an exit status other than 0/1 or
    an error that is not one line are failures."""
    out, err = io.StringIO(), io.StringIO()
    rc = -1
    name = "cli " + " ".join(argv[:1])
    try:
        with _recording(bounds, name), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(argv)
    except CallTimeout:
        bounds.failures.append(f"{name}: no answer within {bounds.timeout} s")
        _abort(bounds)
    except BaseException as e:  # noqa: BLE001 (a traceback escapes main)
        bounds.failures.append(f"{name}: {type(e).__name__} escaped main: {str(e)[:300]}")
        return rc, out.getvalue(), err.getvalue()
    text = err.getvalue()
    if rc not in (0, 1):
        bounds.failures.append(f"{name}: exit status {rc}")
    if "Traceback" in text:
        bounds.failures.append(f"{name}: a traceback on stderr: {text[-300:]}")
    lines = text.splitlines()
    # diff (the checkpoints differ) and ls --verify (a step is corrupt) exit 1 with their report on stdout
    if rc == 1 and not (argv[0] in ("diff", "ls") and not lines) and len(lines) != 1:
        bounds.failures.append(f"{name}: exit 1 with {len(lines)} lines on stderr: {text[:300]!r}")
    return rc, out.getvalue(), text


# ---------------------------------------------------------------------------------------------- comparing data


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``tree``'s leaves by dotted key (dicts by key, lists and tuples by index)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, liferaft.PerRank) and \
            any(isinstance(x, (torch.Tensor, dict, list, tuple)) for x in tree):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def same(a: Any, b: Any) -> bool:
    """Bitwise for tensors (dtype, shape and bytes), ``==`` for plain values, item by item for containers."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                               b.reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 (values that cannot be compared are not the same)
        return False


def template(tree: Any) -> Any:
    """A state to load ``tree`` into: its nesting, tensors of its shapes and dtypes filled with a pattern."""
    if isinstance(tree, torch.Tensor):
        return torch.full_like(tree, 7) if tree.dtype != torch.bool else torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: template(v) for k, v in tree.items()}
    if isinstance(tree, liferaft.PerRank):
        return tree
    if isinstance(tree, list):
        return [template(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(template(v) for v in tree)
    return tree


def canary_check(bounds: Bounds) -> None:
    if fuzz_canary.fired():
        bounds.failures.append(f"code from the checkpoint ran: {fuzz_canary.what()}")
        fuzz_canary.reset()


def is_special(path: str) -> bool:
    """A FIFO, device or socket (never to be opened by the test itself)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))
