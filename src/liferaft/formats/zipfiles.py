"""Zip archives inside checkpoint files (``torch.save`` archives, DCP's blobs): a window onto part of a file, and
the check of every record's CRC-32 that ``verify`` runs where a format carries nothing better."""

from __future__ import annotations

import io
import itertools
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
    """Check the zip archive ``f`` (a ``torch.save`` archive) as ``stored_records`` does, then read every record
    stored uncompressed and check its CRC-32. A compressed record is a fault and is never decompressed: its
    declared size is the writer's word, and a few bytes of bzip2 or deflate inflate to gigabytes (a memory bomb);
    a stored record's bytes are bounded by the file. Returns
    (records checked, their bytes, bytes read, faults, records without a CRC: ``torch.save`` with
    ``compute_crc32`` off writes 0)."""
    records = crc_bytes = nbytes = no_crc = 0
    faults: list[str] = []
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return 0, 0, 0, [f"{what}: not a readable zip archive ({e}); the data is damaged or truncated"], 0
    with zf:
        try:
            stored_records(zf, f)
        except (ValueError, OSError) as e:
            faults.append(f"{what}: {e}; damaged or crafted (a reader would map the wrong bytes)")
        for info in zf.infolist():
            size = 0
            if info.compress_type != zipfile.ZIP_STORED:
                fault = (f"{what}: record {info.filename!r} is compressed (method {info.compress_type}); torch.save "
                         "stores records uncompressed: damaged or crafted, not decompressed")
                if not any(f"record {info.filename!r} is compressed" in x for x in faults):
                    faults.append(fault)
                continue
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




def stored_records(z: zipfile.ZipFile, f: Any) -> dict[str, tuple[int, int]]:
    """{record name: (where its bytes start in ``f``, how many)} of the zip archive ``z`` open on ``f``, once every
    record is checked to be what ``torch.save`` writes and what a memory map of the file can read in place: stored
    uncompressed (ZIP_STORED in the central directory and in its local header: a deflated record would be mapped
    as its compressed bytes), its size equal to its stored size, its bytes (after its LOCAL header, whose own name
    and extra lengths count) inside the file, before the central directory and overlapping no other record, and no
    name twice. ValueError naming the record otherwise."""
    end = f.seek(0, 2)
    directory = getattr(z, "start_dir", end)
    out: dict[str, tuple[int, int]] = {}
    spans = []
    for i in z.infolist():
        if i.filename in out:
            raise ValueError(f"record {i.filename!r} appears twice")
        if i.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {i.filename!r} is compressed (method {i.compress_type}); torch.save stores "
                             "records uncompressed, and liferaft maps them in place")
        if i.file_size != i.compress_size:
            raise ValueError(f"record {i.filename!r} declares {i.file_size} bytes but stores {i.compress_size}")
        f.seek(i.header_offset)
        head = f.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise ValueError(f"record {i.filename!r} has no local header at {i.header_offset}")
        method, n, m = int.from_bytes(head[8:10], "little"), int.from_bytes(head[26:28], "little"), \
            int.from_bytes(head[28:30], "little")
        if method != zipfile.ZIP_STORED:
            raise ValueError(f"record {i.filename!r} is compressed (method {method} in its local header)")
        start = i.header_offset + 30 + n + m
        if start + i.file_size > min(end, directory):
            raise ValueError(f"record {i.filename!r} ({i.file_size} bytes from {start}) runs past the records "
                             f"(into the zip directory or past the file's {end} bytes)")
        out[i.filename] = (start, i.file_size)
        spans.append((i.header_offset, start + i.file_size, i.filename))
    spans.sort()
    for (_, stop, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < stop:
            raise ValueError(f"records {a!r} and {b!r} overlap")
    return out
