"""The ``liferaft`` command: look into a checkpoint without writing any Python.

    liferaft inspect PATH               keys, shapes, dtypes, chunks and bytes (from the manifest only)
    liferaft verify PATH                re-hash every block of every chunk; exit status 1 if anything is wrong
    liferaft read PATH [--key K]...     read the checkpoint and print one line per leaf
    liferaft ls ROOT                    steps under a CheckpointManager root: status, size, age, writer, references
    liferaft gc ROOT --keep-last N ...  the manager's retention from the command line (--dry-run to preview)
    liferaft diff A B [--key GLOB]...   keys added / removed / changed, max abs and relative difference per tensor
    liferaft convert SRC DST --to FMT   liferaft ↔ safetensors, torch (torch.save), dcp; → hf (a loadable model)
    liferaft plan [--costs F.json] ...  expected goodput of no tiers / remote only / tiers / per-step log at scale

Every command that takes a checkpoint (inspect, verify, read, diff, convert) takes each format liferaft reads:
liferaft, a DCP folder, safetensors (file or folder), a ``torch.save`` file; ls and gc take a CheckpointManager
root and say so when given a checkpoint.

One module per group of commands: ``checkpoint`` (inspect, verify, read), ``root`` (ls, gc), ``compare`` (diff,
convert), ``plan``; ``progress`` holds the progress bars. Each adds its subcommands to the parser and runs them.

The commands use the public API only: the names of ``liferaft.__all__`` and the documented public modules
``liferaft.errors``, ``liferaft.options`` and ``liferaft.storage`` (docs/API.md), with these exceptions, each
marked where it is imported (``# not public:``) and listed in docs/API.md:

- ``plan`` uses the goodput model ``liferaft.manager.goodput`` (pure arithmetic, not part of the API).

``inspect``, ``verify`` and ``read`` take every format through ``liferaft.inspect`` / ``verify`` / ``read``.

``--json`` (every command) prints one JSON document for scripts. Everything printed goes through
``output.printable``: a key, path or message from a checkpoint cannot send a terminal escape sequence. The command never prints a traceback (unless
``--debug``): errors are printed to stderr as one line naming the file or argument and give exit status 1 (any
other exception too, as an "internal error" line with its type); usage errors, and argument values argparse's
``type=`` validators refuse (``liferaft.cli.args``: numbers, counts, regexes), give exit status 2; ``diff`` exits 1
when the checkpoints differ, ``ls --verify`` when a step is corrupt (every step still listed); 130 on Ctrl-C.
Output is linear in the number of keys.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import liferaft
from liferaft.cli import checkpoint, compare, plan, root
from liferaft.cli.output import PrintableOutput, printable


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``liferaft`` command: each subcommand's parser has its function as ``run``."""
    parser = argparse.ArgumentParser(prog="liferaft", description="Inspect, verify, compare, convert and manage "
                                     "liferaft checkpoints.")
    parser.add_argument("--version", action="version", version=f"liferaft {liferaft.__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (checkpoint, root, compare, plan):
        group.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``liferaft`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2), --help / --version (0)
        return e.code if isinstance(e.code, int) else 1
    try:
        with contextlib.redirect_stdout(PrintableOutput(sys.stdout)):
            status: int = args.run(args)
        return status
    except BrokenPipeError:                     # the reader went away (``liferaft inspect X | head``): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"liferaft {args.command}: interrupted", file=sys.stderr)
        return 130
    except (liferaft.LiferaftError, OSError) as e:
        _report(args, (str(e).splitlines() or [type(e).__name__])[0])
        return 1
    except Exception as e:  # noqa: BLE001 - the last resort: one line, never a traceback (unless --debug)
        first = (str(e).splitlines() or [""])[0][:500]
        _report(args, f"internal error: {type(e).__name__}: {first} (a liferaft bug: please report it; --debug "
                      "shows the traceback)")
        return 1


def _report(args: argparse.Namespace, line: str) -> None:
    """One error line on stderr (with ``--debug``, after the traceback of the exception being handled)."""
    if args.debug:
        import traceback

        traceback.print_exc()
    print(f"liferaft {args.command}: error: {printable(line)}", file=sys.stderr)


__all__ = ["build_parser", "main"]
