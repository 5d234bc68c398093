"""Whether a local folder lives in memory (tmpfs, ramfs): there a read is a copy from RAM, with no device latency
to hide, and a load streams it through a small cache-resident buffer instead (``core.chunks.memread``).

Decided from this process's mount table (``/proc/self/mountinfo``): the file system of the longest mount point
above the folder. Only the speed of a load depends on the answer, never which bytes it reads (the ranks of a
load agree on one read size, ``core.open``); where the table
cannot be read (not Linux), the answer is False (the device path, correct everywhere).
"""

from __future__ import annotations

import functools
import os

#: File systems whose files are pages of RAM.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_of(path: str, mountinfo: str) -> str | None:
    """The file system type of ``path`` (absolute, links resolved) in the text of a mountinfo table: that of
    the longest mount point containing it (the last one listed when one point is mounted over); None if no
    line fits. Pure; malformed lines are skipped."""
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or not after:
            continue
        point = _unescape(fields[4])
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, fstype = len(point), after[0]
    return fstype


@functools.lru_cache(maxsize=256)
def in_memory(path: str) -> bool:
    """Whether the folder ``path`` is on a file system held in RAM (tmpfs, ramfs). Cached per path for the
    process (mounts do not move under a running job; a stale answer only changes how fast a load reads)."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            table = f.read(1 << 22)
    except OSError:
        return False
    return filesystem_of(os.path.realpath(path), table) in MEMORY_FILESYSTEMS


__all__ = ["MEMORY_FILESYSTEMS", "filesystem_of", "in_memory"]
