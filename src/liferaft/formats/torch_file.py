"""Writing ``torch.save`` archives whose tensors are streamed in, never all in memory (for the torch and DCP
exports).

``torch.save`` pickles the whole object and then writes each storage from memory. Here the object is saved first
with placeholder tensors (fake tensors: shape and dtype, no memory) under
``torch.serialization.skip_data(materialize_fake_tensors=True)``, which lays the archive out with every storage's record reserved (a hole) at its
final offset; loading the archive to the meta device tells each tensor's record offset; ``RecordFiller`` then
writes the values into those records slab by slab (O_DIRECT for the pages a slab covers whole; the page cache of
these VMs writes at a fraction of the disk's speed), and ``set_crcs`` writes each record's zip CRC-32 (local header,
data descriptor, central directory entry), so the file is a valid zip archive, not only one ``torch.load``
accepts. ``torch.load(..., weights_only=True)`` (with or without ``mmap=True``) reads the result.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from liferaft.errors import CorruptCheckpointError, PickleNotAllowedError, StorageError
from liferaft.formats.base import CheckReport, Reader, TensorSpec, ValueSpec, copy_from
from liferaft.formats.torch_checks import scan, scan_legacy
from liferaft.formats.zipfiles import View, check_zip
from liferaft.state.dtypes import dtype_name
from liferaft.state.tree import build_tree
from liferaft.storage import files

PAGE = 4096


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with shape and dtype but no memory (a fake tensor: a 40 GiB placeholder costs nothing, not even
    address space the kernel could refuse)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype)


def skeleton(f: Any, obj: Any) -> int:
    """``torch.save(obj)`` (holding ``placeholder`` tensors) at the position of the real file ``f``, without the
    storages' bytes (holes left for them); returns its length. ``f`` is flushed."""
    at = f.tell()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, f)
    f.flush()
    return f.tell() - at


def record_offsets(path: str, start: int, length: int) -> Any:
    """The archive at ``[start, start + length)`` of ``path`` loaded to the meta device: each tensor's
    ``untyped_storage()._checkpoint_offset`` is its record's offset from ``start`` (only the pickle is read)."""

    with open(path, "rb") as f:
        return torch.load(View(f, start, length), map_location="meta", weights_only=True)


def with_crc(slabs: Iterable[torch.Tensor], crc: list[int]) -> Iterator[torch.Tensor]:
    """The slabs, keeping ``crc[0]`` the running CRC-32 of the bytes so far (computed where this iterator runs:
    in a prefetch thread, beside the writes; read it once the iterator is exhausted)."""
    crc[0] = 0
    for t in slabs:
        crc[0] = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc[0])
        yield t


class RecordFiller:
    """Positioned writes of slabs into an existing file: a slab whose address does not fall on the file's page
    boundaries is copied into a reused aligned buffer first, so its whole pages can go through O_DIRECT."""

    def __init__(self, path: str, stage_bytes: int = 64 << 20) -> None:
        from liferaft.staging.pool import page_aligned_empty
        from liferaft.storage.posix import _PosixWriter

        self.w = _PosixWriter(path, direct=True, truncate=False)
        self.stage = page_aligned_empty(stage_bytes + PAGE)
        self.stage_bytes = stage_bytes

    def fill(self, at: int, slabs: Iterable[torch.Tensor], progress: Callable[[int], None] | None = None) -> int:
        """Write the slabs one after the other from offset ``at``; returns the bytes written."""
        pos = at
        try:
            for t in slabs:
                data = t.contiguous().reshape(-1).view(torch.uint8)
                n = data.numel()
                if (data.data_ptr() - pos) % PAGE == 0 or n < 2 * PAGE:
                    self.w.pwrite(memoryview(data.numpy()), pos)
                else:
                    for lo in range(0, n, self.stage_bytes):
                        m, shift = min(self.stage_bytes, n - lo), (pos + lo) % PAGE
                        self.stage[shift:shift + m].copy_(data[lo:lo + m])
                        self.w.pwrite(memoryview(self.stage[shift:shift + m].numpy()), pos + lo)
                pos += n
                if progress is not None:
                    progress(n)
        finally:
            close = getattr(slabs, "close", None)               # stops a prefetch thread on an error too
            if close is not None:
                close()
        return pos - at

    def close(self) -> None:
        """Fsync and close."""
        self.w.close()

    def abort(self) -> None:
        """Close without fsync (the caller removes the file)."""
        self.w.abort(unlink=False)


def set_crcs(path: str, start: int, length: int, crcs: dict[int, tuple[int, int]]) -> None:
    """Write the CRC-32 of each filled record of the archive at ``[start, start + length)`` of ``path``
    (``crcs``: absolute data offset -> (crc, length)) into its local header, data descriptor and central
    directory entry."""

    with os.fdopen(os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)), "r+b") as f:
        z = zipfile.ZipFile(io.BufferedReader(View(f, start, length)))
        names: dict[str, int] = {}
        for info in z.infolist():
            f.seek(start + info.header_offset + 26)
            n, m = struct.unpack("<HH", f.read(4))
            data_at = start + info.header_offset + 30 + n + m
            if data_at not in crcs:
                continue
            crc, size = crcs[data_at]
            names[info.filename] = crc
            f.seek(start + info.header_offset + 14)
            f.write(struct.pack("<I", crc))
            if info.flag_bits & 0x08:                   # a data descriptor follows the data
                f.seek(data_at + size)
                sig = f.read(4)
                f.seek(data_at + size + (4 if sig == b"PK\x07\x08" else 0))
                f.write(struct.pack("<I", crc))
        pos = start + z.start_dir
        for _ in z.infolist():
            f.seek(pos)
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                raise StorageError(f"{path}: torch.save wrote an archive whose central directory liferaft cannot walk")
            n, m, k = struct.unpack("<HHH", head[28:34])
            name = f.read(n).decode()
            if name in names:
                f.seek(pos + 16)
                f.write(struct.pack("<I", names[name]))
            pos += 46 + n + m + k
        if len(names) != len(crcs):
            raise StorageError(f"{path}: torch.save wrote records liferaft could not find in the archive")


def write_torch_file(dst: str, tree: Any,
                     fills: list[tuple[tuple[Any, ...], Callable[[int, list[int]], Iterable[torch.Tensor]]]],
                     progress: Callable[[int], None] | None = None) -> int:
    """Save ``tree`` (holding placeholder tensors) to ``dst``, then stream each placeholder's values into its
    record: ``fills`` maps a tensor's path in ``tree`` to a function that, given the record's file offset and a
    one-item list, yields the slabs in row-major order and leaves their CRC-32 in the list (``with_crc``). Written to ``dst + ".tmp"`` (removed
    on any error), fsynced, then renamed. Returns the file size."""
    folder, base = os.path.split(os.path.abspath(dst))
    files.check_target(dst)                 # a folder there: refused before a byte is written
    tmp = os.path.join(folder, f"{base}.tmp-{uuid.uuid4().hex[:12]}")   # fresh, created exclusively: no planted link
    fd, at_dir = files.create_exclusive(folder, os.path.basename(tmp), replace=False)
    os.close(at_dir)
    filler = None
    try:
        with os.fdopen(fd, "wb") as f:
            length = skeleton(f, tree)
        meta = record_offsets(tmp, 0, length)
        crcs: dict[int, tuple[int, int]] = {}
        filler = RecordFiller(tmp)
        for path, produce in fills:
            m = meta
            for p in path:
                m = m[p]
            at = m.untyped_storage()._checkpoint_offset
            crc = [0]
            n = filler.fill(at, produce(at, crc), progress)
            if n != m.untyped_storage().nbytes():
                raise StorageError(f"{dst}: wrote {n} bytes for {list(path)}, its record holds "
                                   f"{m.untyped_storage().nbytes()}")
            crcs[at] = (crc[0], n)
        filler.close()
        filler = None
        set_crcs(tmp, 0, length, crcs)
    except BaseException:
        if filler is not None:
            filler.abort()
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    files.put_in_place(tmp, dst)            # a failure removes tmp and names dst (FileAccessError)
    from liferaft.storage import fsync_dir

    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    return length


# --------------------------------------------------------------------------- reading


def torch_file_state(path: str | os.PathLike[str]) -> Any:
    """A ``torch.save`` file loaded with ``weights_only=True`` (no code runs), memory-mapped where the archive
    allows it (the legacy, pre-zip format is read whole), once ``formats.torch_checks`` found every storage backed
    by its record and every tensor inside its storage. Any refusal is a LiferaftError naming the file (and the
    key where there is one)."""
    p = os.fspath(path)
    # one descriptor for every read (a regular file, checked once: a FIFO or another file swapped in by name later
    # is never opened); torch.load maps it by its /proc/self/fd name where there is one
    with os.fdopen(files.open_path(p), "rb") as f:
        if not zipfile.is_zipfile(f):
            f.seek(0)
            head = f.read(16)
            if not head.startswith(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"):
                raise CorruptCheckpointError(f"{p}: not a torch.save file (neither a zip archive nor torch's legacy "
                                             "format), nor any other checkpoint format liferaft reads")
            f.seek(0)
            scan_legacy(f, p)                   # storages and views checked before anything is allocated
        else:
            f.seek(0)
            scan(f, p)                          # every storage within its record, every view within its storage
        own = f"/proc/self/fd/{f.fileno()}"
        name = own if os.path.exists(own) else p
        return _load_weights(name, p)


def _load_weights(name: str, p: str) -> Any:
    """``torch.load(name, weights_only=True)``, memory-mapped where the archive allows it; ``p`` names the file in
    errors."""
    try:
        try:
            return torch.load(name, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(name, weights_only=True, map_location="cpu")     # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        why = next((x.strip() for x in str(e).splitlines() if "WeightsUnpickler error" in x),
                   (str(e).splitlines() or [""])[0])
        raise PickleNotAllowedError(f"{p}: weights_only loading refuses it ({why.split('. Please')[0]}); liferaft "
                                    "never runs code from a checkpoint: load it with torch.load(weights_only=False) "
                                    "if you trust its author") from e
    except (RuntimeError, EOFError, ValueError, OverflowError, TypeError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{p}: not a readable torch.save file ({(str(e).splitlines() or [''])[0]})") \
            from e


def torch_file_tree(obj: Any) -> Any:
    """The state a ``torch.save`` file's object stands for, the one rule the torch reader and ``convert`` share: a
    dict, list or tuple as it is (a top-level list's items are keys ``0``, ``1``, ...), anything else (one tensor,
    one number) under the key ``state``."""
    return obj if isinstance(obj, (dict, list, tuple)) else {"state": obj}


class TorchFileReader(Reader):
    """A ``torch.save`` file, loaded with ``weights_only=True`` and memory-mapped (``torch_file_state``): its
    tensors by their liferaft keys (``model.layer.weight``), its other leaves as plain values, nested as saved."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from liferaft.state.flatten import flatten

        state = torch_file_state(path)
        flat = flatten(torch_file_tree(state))
        self._full = {leaf.key: leaf.parts[0][1] for leaf in flat.tensors}
        self._values = {k: v for k, _, v in flat.values}
        self._kinds = {c.path: c.kind for c in flat.containers}
        self._paths = {leaf.key: tuple(leaf.path) for leaf in flat.tensors} | {k: tuple(p) for k, p, _ in flat.values}
        super().__init__(url=os.fspath(path), fmt="torch", tensors={
            leaf.key: TensorSpec(key=leaf.key, dtype=dtype_name(leaf.dtype), shape=tuple(leaf.shape), kind=leaf.kind,
                                 path=tuple(leaf.path), boxes=((tuple(0 for _ in leaf.shape), tuple(leaf.shape)),),
                                 nbytes=self._full[leaf.key].numel() * self._full[leaf.key].element_size())
            for leaf in flat.tensors}, values={k: ValueSpec(key=k, path=tuple(p)) for k, p, _ in flat.values})

    def value(self, key: str) -> Any:
        return self._values[key]

    def copy_box(self, key: str, offsets: Any, out: torch.Tensor) -> int:
        return copy_from(self._full[key], offsets, out)

    def tree(self, leaves: Any) -> Any:
        return build_tree({p: k for p, k in self._kinds.items()
                           if any(self._paths[key][:len(p)] == p for key in leaves)},
                          {self._paths[k]: v for k, v in leaves.items()})

    def close(self) -> None:
        self._full, self._values = {}, {}       # the memory-mapped tensors go with them

    def verify(self, progress: Callable[[int], None] | None = None) -> CheckReport:
        """Every zip record read with its CRC-32 checked (torch.save's legacy format carries none)."""
        p, unchecked = self.url, []
        with os.fdopen(files.open_path(p), "rb") as f:
            zipped = zipfile.is_zipfile(f)
            if zipped:
                f.seek(0)
                records, crc_bytes, nbytes, faults, no_crc = check_zip(f, f"file {os.path.basename(p)!r}", progress)
        if not zipped:
            records = crc_bytes = no_crc = 0
            nbytes, faults = os.path.getsize(p), []
            unchecked.append("torch.save's legacy (pre-zip) format carries no checksums")
        if no_crc:
            unchecked.append(f"{no_crc} zip record(s) written without a CRC-32 (torch.save with compute_crc32 off)")
        return CheckReport(path=p, fmt=self.fmt, units=records, checked_bytes=crc_bytes, bytes_read=nbytes,
                           unchecked=tuple(unchecked), faults=tuple(faults))
