"""Zip archives inside checkpoint files (``torch.save`` archives, DCP's blobs): a window onto part of a file, and
the check of every record's CRC-32 that ``verify`` runs where a format carries nothing better."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from typing import Any


class View(io.RawIOBase):
    """A read-only window ``[start, start + length)`` of an open file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def drain(f: Any, progress: Callable[[int], None] | None) -> int:
    """Read ``f`` to its end in 8 MiB pieces (``progress`` told each piece's size); the bytes read."""
    done = 0
    while True:
        piece = f.read(8 << 20)
        if not piece:
            return done
        done += len(piece)
        if progress is not None:
            progress(len(piece))


def check_zip(f: Any, what: str, progress: Callable[[int], None] | None) -> tuple[int, int, int, list[str], int]:
    """Read every record of the zip archive ``f`` (a ``torch.save`` archive) and check its CRC-32. Returns
    (records checked, their bytes, bytes read, faults, records without a CRC: ``torch.save`` with
    ``compute_crc32`` off writes 0)."""
    records = crc_bytes = nbytes = no_crc = 0
    faults: list[str] = []
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return 0, 0, 0, [f"{what}: not a readable zip archive ({e}); the data is damaged or truncated"], 0
    with zf:
        for info in zf.infolist():
            size = 0
            try:
                with zf.open(info) as member:
                    size = drain(member, progress)
                records += 1
                crc_bytes += size
            except zipfile.BadZipFile as e:
                if info.CRC == 0 and "CRC" in str(e):
                    no_crc += 1
                else:
                    faults.append(f"{what}: record {info.filename!r}: {e}; the stored data is damaged")
            except (OSError, EOFError, ValueError, zipfile.LargeZipFile) as e:
                faults.append(f"{what}: record {info.filename!r} cannot be read ({e}); the data is damaged or "
                              "truncated")
            nbytes += size
    return records, crc_bytes, nbytes, faults, no_crc


