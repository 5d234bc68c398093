"""Run the fuzzing suite in this process's place under its bounds: an address-space limit (RLIMIT_AS, so an
allocation bomb is a MemoryError, not a dead machine) and the examples budget (passed to tests/fuzz/conftest.py
by environment). Used by tests/unit/test_fuzz.py (small, derandomized) and ``make fuzz`` (large, random).

    python tests/fuzz/run.py [--examples N] [--random] [--memory-gib G] [--call-timeout S] [pytest args...]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=6, help="examples per target")
    p.add_argument("--random", action="store_true", help="a fresh random seed (default: derandomized)")
    p.add_argument("--memory-gib", type=float, default=4.0, help="address-space limit of the fuzz process")
    p.add_argument("--call-timeout", type=int, default=10, help="seconds per API call or CLI command")
    args, rest = p.parse_known_args()
    limit = int(args.memory_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # glibc reserves 64 MiB of address space per thread's malloc arena: few arenas, so the limit bounds allocations
    env = dict(os.environ, MALLOC_ARENA_MAX="2", LIFERAFT_FUZZ_EXAMPLES=str(args.examples), LIFERAFT_FUZZ_RANDOM="1" if args.random else "",
               LIFERAFT_FUZZ_CALL_TIMEOUT=str(args.call_timeout))
    here = os.path.dirname(os.path.abspath(__file__))
    argv = [sys.executable, "-m", "pytest", here, "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
            "--hypothesis-show-statistics", *rest]
    os.execve(sys.executable, argv, env)


if __name__ == "__main__":
    main()
