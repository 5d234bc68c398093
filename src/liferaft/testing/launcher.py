"""Run a function on N real ranks: one process each, gloo over 127.0.0.1, with a hard timeout.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every rank after
``torch.distributed.init_process_group("gloo")`` and returns the list of return values (rank order). If a
rank raises, dies or the run exceeds ``timeout`` seconds, every process is killed and RankFailure is raised
with each rank's traceback. ``fn`` must be importable (a module-level function). Processes come from a fork
server that has torch imported already, so a launch costs well under a second.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(AssertionError):
    """One or more ranks failed; ``errors`` maps rank → traceback text (or exit description)."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the forkserver the ranks are forked from imports once. A process has one forkserver: whatever else
#: starts it (a test's helper) should preload these too, or every rank imports them again. ``_preload`` imports
#: what rank functions commonly import besides (``torch._dynamo`` first: every rank that constructed an optimizer
#: imported it, ~0.6 CPU s, most of the CPU of the test suite's ~1,500 rank processes: 780 -> 234 CPU s), each
#: only if it imports cleanly (the fork server dies on any error but an ImportError).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "numpy", "liferaft",
           "liferaft.testing._preload")


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, env: dict[str, str],
           pg_timeout: float, results: Any) -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        except Exception as e:      # (the port taken meanwhile: the parent launches again on another)
            if "EADDRINUSE" in str(e) or "address already in use" in str(e):
                results.put((rank, None, "port"))
                return
            raise
        try:
            out = fn(rank, world, *args)
        finally:
            with contextlib.suppress(Exception):    # teardown after a failure must not mask it
                dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              pg_timeout: float = 60.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; see the module doc. A port another
    process took between ``free_port`` and the rendezvous (tests side by side) launches again on another, before
    ``fn`` ran anywhere (at most 5 times)."""
    for _ in range(4):
        try:
            return _run_ranks(fn, world_size, args, timeout, pg_timeout, env)
        except _PortTaken:
            continue
    return _run_ranks(fn, world_size, args, timeout, pg_timeout, env)


class _PortTaken(Exception):
    """Rank 0 could not listen on the rendezvous port (another process took it since it was found free)."""


def _run_ranks(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float,
               env: dict[str, str] | None) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, dict(env or {}), pg_timeout, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    for r in range(world_size):
                        if r not in out and r not in errors:
                            errors[r] = f"no result within {timeout:.0f}s (hung?)"
                    break
                for r, p in enumerate(procs):
                    if r not in out and r not in errors and not p.is_alive() and p.exitcode not in (0, None):
                        # give its queued message a moment to arrive before declaring it dead
                        time.sleep(0.5)
                        if results.empty():
                            errors[r] = f"process died with exit code {p.exitcode}"
                continue
            if ok is None:                  # (the port was taken: the others wait for a rendezvous that never comes)
                raise _PortTaken()
            (out if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors and len(out) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailure(errors)
    return [out[r] for r in range(world_size)]
