"""Every checkpoint format the tools take, behind one detector and one reader, so that every command that takes a
checkpoint takes each of them (docs/CLI.md, "Formats").

- ``detect(path)``: "liferaft" (a ``COMMIT`` marker, an unfinished liferaft save, or any URL), "dcp" (a folder with
  ``.metadata``), "safetensors" (a ``.safetensors`` file, a folder with ``model.safetensors`` or its index) or
  "torch" (any other file: a ``torch.save`` archive). ``sniff`` is the same without raising; ``detect_names``
  decides from a folder's listing (a manager root's step folders, an object store).
- ``open_source(path, keys)``: a ``Source``: the tensors (dtype, shape, kind) and plain values of a checkpoint in
  any of these formats, each tensor read by boxes on demand (``inspect``, ``read``, ``diff``, ``verify``).
- ``check_source(path)``: what ``verify`` can check where liferaft's checksums are absent: DCP's and
  ``torch.save``'s zip records carry a CRC-32 each (every one is checked); safetensors carry none (the header and
  the data layout are checked and every byte read, which is all that can be).
"""

from __future__ import annotations

import fnmatch
import io
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from liferaft.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from liferaft.options import LoadOptions

FORMATS = ("liferaft", "dcp", "safetensors", "torch")
INDEX = "model.safetensors.index.json"
#: How messages name each format.
NAMES = {"liferaft": "liferaft checkpoint", "dcp": "DCP checkpoint", "safetensors": "safetensors checkpoint",
         "torch": "torch.save file"}


def detect_names(names: Iterable[str]) -> str | None:
    """The format of a folder from the names of the files in it (relative, ``/``-separated; nested ones too):
    None when they show none."""
    top = {n.split("/", 1)[0] for n in names}
    if "COMMIT" in top or "data" in top or any(n.startswith("manifest-") for n in top):
        return "liferaft"                   # an unfinished or damaged one too: liferaft's reader says what is wrong
    if ".metadata" in top:
        return "dcp"
    if "model.safetensors" in top or INDEX in top:
        return "safetensors"
    return None


def sniff(path: Any) -> str | None:
    """``detect`` without raising: None for a path that does not exist or holds nothing recognizable."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = os.fspath(path)
    if "://" in p:
        return "liferaft"
    if os.path.isfile(p):
        return "safetensors" if p.endswith(".safetensors") else "torch"
    if not os.path.isdir(p):
        return None
    names = os.listdir(p)
    if "data" in names and not os.path.isdir(os.path.join(p, "data")):
        names.remove("data")
    return detect_names(names)


def detect(path: str | os.PathLike[str]) -> str:
    """What ``path`` holds (one of ``FORMATS``); raises CheckpointNotFoundError when the path does not exist and
    StateMismatchError when nothing there is recognizable."""
    fmt = sniff(path)
    if fmt is not None:
        return fmt
    p = os.fspath(path)
    if not os.path.exists(p):
        raise CheckpointNotFoundError(f"{p}: no checkpoint there (the path does not exist)")
    raise StateMismatchError(f"{p}: not a liferaft checkpoint, DCP checkpoint, safetensors folder or torch.save "
                             "file (nothing recognizable there); pass the format explicitly")


@dataclass
class Source:
    """A checkpoint in any format, read on demand: tensors by key as (dtype name, shape, kind), ``read(key, box)``
    for the values of one box ``(offsets, sizes)`` of a tensor, the plain values by key (decoded when called),
    and for DCP each tensor's saved chunks and the nesting DCP recorded per key."""

    url: str
    fmt: str
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    read: Callable[[str, Any], torch.Tensor]
    values: dict[str, Callable[[], Any]]
    chunks: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def renamed(self, rename: Callable[[str], str]) -> "Source":
        """The same checkpoint with every key renamed by ``rename`` (two keys to one name: OptionsError)."""
        from liferaft.errors import OptionsError

        old = {rename(k): k for k in [*self.tensors, *self.values]}
        if len(old) != len(self.tensors) + len(self.values):
            raise OptionsError(f"{self.url}: the renaming maps two keys to one name")
        read = self.read
        return Source(self.url, self.fmt, {rename(k): v for k, v in self.tensors.items()},
                      lambda k, box: read(old[k], box), {rename(k): v for k, v in self.values.items()},
                      {rename(k): v for k, v in self.chunks.items()})      # (the recorded nesting no longer fits)

    def selected(self, keys: Sequence[str] | None) -> "Source":
        """Only the keys matching one of the globs ``keys`` (all for None)."""
        if not keys:
            return self

        def keep(k: str) -> bool:
            return any(fnmatch.fnmatchcase(k, p) for p in keys)
        return Source(self.url, self.fmt, {k: v for k, v in self.tensors.items() if keep(k)}, self.read,
                      {k: v for k, v in self.values.items() if keep(k)}, self.chunks, self.paths)


def _dt(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def _box(t: torch.Tensor, box: Any) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(*box)):
        t = t.narrow(d, o, n)
    return t


def torch_file_state(path: str | os.PathLike[str]) -> Any:
    """A ``torch.save`` file loaded with ``weights_only=True`` (no code runs), memory-mapped where the archive
    allows it (the legacy, pre-zip format is read whole)."""
    import pickle

    from liferaft.errors import PickleNotAllowedError

    p = os.fspath(path)
    if not zipfile.is_zipfile(p):
        with open(p, "rb") as f:
            head = f.read(16)
        if not head.startswith(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"):
            raise CorruptCheckpointError(f"{p}: not a torch.save file (neither a zip archive nor torch's legacy "
                                         "format), nor any other checkpoint format liferaft reads")
    try:
        try:
            return torch.load(p, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(p, weights_only=True, map_location="cpu")    # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        why = next((x.strip() for x in str(e).splitlines() if "WeightsUnpickler error" in x),
                   (str(e).splitlines() or [""])[0])
        raise PickleNotAllowedError(f"{p}: weights_only loading refuses it ({why.split('. Please')[0]}); liferaft "
                                    "never runs code from a checkpoint: load it with torch.load(weights_only=False) "
                                    "if you trust its author") from e
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{p}: not a readable torch.save file ({(str(e).splitlines() or [''])[0]})") \
            from e


def open_source(path: str | os.PathLike[str], keys: Sequence[str] | None = None,
                options: LoadOptions | None = None) -> Source:
    """The tensors and values of a checkpoint in any format ``detect`` knows (``keys``: globs to keep), read on
    demand: liferaft's verified like any load, the others as they are (memory-mapped)."""
    opts = options or LoadOptions()
    fmt = detect(path)
    picked = (lambda k: not keys or any(fnmatch.fnmatchcase(k, p) for p in keys))
    if fmt == "liferaft":
        from liferaft.reading import check_files, decode_entry_value, open_checkpoint
        from liferaft.storage import resolve
        from liferaft.storage.refs import with_references
        from liferaft.tools._slabs import read_box

        st = with_references(resolve(path))
        m = open_checkpoint(st)
        ts = {e.key: e for e in m.tensors if picked(e.key)}
        check_files(st, m, {c.file for e in ts.values() for c in e.chunks})
        return Source(st.url, fmt, {k: (e.dtype, tuple(e.shape), e.kind) for k, e in ts.items()},
                      lambda k, box: read_box(st, ts[k], box, opts.max_read_bytes),
                      {v.key: (lambda v=v: decode_entry_value(v, opts.allow_pickle)) for v in m.values
                       if picked(v.key)},
                      paths={e.key: tuple(e.path) for e in [*m.tensors, *m.values] if picked(e.key)})
    if fmt == "dcp":
        from liferaft.tools.dcp_format import DcpCheckpoint

        ck = DcpCheckpoint(path)

        def read_dcp(k: str, box: Any) -> torch.Tensor:
            out = torch.empty(box[1], dtype=ck.tensors[k].dtype)
            ck.copy_box(k, box[0], out)
            return out
        return Source(os.fspath(path), fmt, {k: (_dt(t.dtype), t.shape, "tensor") for k, t in ck.tensors.items()
                                             if picked(k)}, read_dcp,
                      {k: (lambda k=k: ck.value(k)) for k in ck.values if picked(k)},
                      {k: t.chunks for k, t in ck.tensors.items()}, ck.paths)
    if fmt == "safetensors":
        from liferaft.tools.convert import safetensors_state

        mapped = safetensors_state(path, keys)
        return Source(os.fspath(path), fmt, {k: (_dt(t.dtype), tuple(t.shape), "tensor") for k, t in mapped.items()},
                      lambda k, box: _box(mapped[k], box), {})
    from liferaft.state.flatten import flatten

    state = torch_file_state(path)
    flat = flatten(state if isinstance(state, (dict, list, tuple)) else {"state": state})
    full = {leaf.key: leaf.parts[0][1] for leaf in flat.tensors if picked(leaf.key)}
    return Source(os.fspath(path), fmt, {k: (_dt(t.dtype), tuple(t.shape), "tensor") for k, t in full.items()},
                  lambda k, box: _box(full[k], box), {k: (lambda v=v: v) for k, _, v in flat.values if picked(k)},
                  paths={leaf.key: tuple(leaf.path) for leaf in flat.tensors} | {k: tuple(p) for k, p, _ in
                                                                                  flat.values})


# --------------------------------------------------------------------------- verify, for the other formats


@dataclass(frozen=True)
class CheckReport:
    """What ``check_source`` checked: ``records`` zip records whose CRC-32 matched (``crc_bytes`` bytes),
    ``bytes_read`` bytes read in all, ``unchecked`` a list of what carried nothing to check against, ``faults``."""

    path: str
    fmt: str
    records: int
    crc_bytes: int
    bytes_read: int
    unchecked: tuple[str, ...]
    faults: tuple[str, ...]


class _Window(io.RawIOBase):
    """A read-only window ``[start, start + length)`` of an open file, for ``zipfile``."""

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


def _check_zip(f: Any, what: str, progress: Callable[[int], None] | None) -> tuple[int, int, int, list[str], int]:
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
                    while True:
                        piece = member.read(8 << 20)
                        if not piece:
                            break
                        size += len(piece)
                        if progress is not None:
                            progress(len(piece))
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


def check_source(path: str | os.PathLike[str], progress: Callable[[int], None] | None = None) -> CheckReport:
    """``verify`` for a checkpoint liferaft did not write (``detect`` says which): every byte is read and checked
    as far as the format allows. A DCP folder: every data file the metadata names exists and is long enough, and
    every blob (one ``torch.save`` archive per chunk and per value) is read with its records' zip CRC-32 checked;
    a ``torch.save`` file the same for its records; a safetensors file or folder has no checksums, so its header
    and data offsets are checked against the file sizes and every byte is read — damaged values that keep their
    length cannot be found there."""
    fmt = detect(path)
    p = os.fspath(path)
    records = crc_bytes = nbytes = no_crc = 0
    faults: list[str] = []
    unchecked: list[str] = []
    if fmt == "liferaft":
        raise StateMismatchError(f"{p}: a liferaft checkpoint: liferaft.verify checks it against its own checksums")
    if fmt == "dcp":
        from liferaft.tools.dcp_format import DcpCheckpoint

        ck = DcpCheckpoint(p)
        blobs: dict[tuple[str, int, int], tuple[str, str, tuple[str, ...]]] = {}
        for key, t in ck.tensors.items():
            for c in t.chunks:
                blobs.setdefault((c.file, c.offset, c.length), (key, f"chunk at {list(c.offsets)}", c.transforms))
        for key, info in ck.values.items():
            file = ck._inside(info.relative_path, key)
            blobs.setdefault((file, int(info.offset), int(info.length)),
                             (key, "value", tuple(getattr(info, "transform_descriptors", None) or ())))
        sizes: dict[str, int | None] = {}
        for (file, offset, length), (key, part, transforms) in blobs.items():
            name = os.path.relpath(file, p)
            if file not in sizes:
                sizes[file] = os.path.getsize(file) if os.path.isfile(file) else None
                if sizes[file] is None:
                    faults.append(f"data file {name!r} is missing")
            if sizes[file] is None:
                continue
            what = f"file {name!r} (key {key!r}, {part}, bytes {offset}..{offset + length})"
            if offset + length > sizes[file]:
                faults.append(f"{what}: the file has {sizes[file]} bytes; truncated")
                continue
            if transforms:                          # a DCP extension (zstd, ...): read through DCP's transforms
                try:
                    if part == "value":
                        ck.value(key)
                    else:
                        ck.chunk(key, next(c for c in ck.tensors[key].chunks if c.file == file and
                                           c.offset == offset))
                    nbytes += length
                    unchecked.append(f"{key} ({part}: stored through {'+'.join(transforms)})")
                except Exception as e:  # noqa: BLE001 - any failure of the extension is a fault of this blob
                    faults.append(f"{what}: cannot be read ({e})")
                continue
            with open(file, "rb") as f:
                r, cb, n, fs, nc = _check_zip(io.BufferedReader(_Window(f, offset, length)), what, progress)
            records, crc_bytes, nbytes, no_crc = records + r, crc_bytes + cb, nbytes + n, no_crc + nc
            faults += fs
    elif fmt == "torch":
        if zipfile.is_zipfile(p):
            with open(p, "rb") as f:
                records, crc_bytes, nbytes, faults, no_crc = _check_zip(f, f"file {os.path.basename(p)!r}", progress)
        else:
            torch_file_state(p)                     # the legacy format: no checksums; it loads or it does not
            nbytes = os.path.getsize(p)
            unchecked.append("torch.save's legacy (pre-zip) format carries no checksums")
    else:
        for file in _st_files(p):
            n, fs = _check_safetensors(file, os.path.relpath(file, p) if file != p else os.path.basename(p),
                                       progress)
            nbytes += n
            faults += fs
        unchecked.append("safetensors carry no checksums")
    if no_crc:
        unchecked.append(f"{no_crc} zip record(s) written without a CRC-32 (torch.save with compute_crc32 off)")
    return CheckReport(path=p, fmt=fmt, records=records, crc_bytes=crc_bytes, bytes_read=nbytes,
                       unchecked=tuple(unchecked), faults=tuple(faults))


def under(keys: Iterable[str], prefix: str) -> list[str]:
    """The keys equal to ``prefix`` or below it (``"model"`` selects ``model.*``)."""
    return [k for k in keys if k == prefix or k.startswith(prefix + ".")]



def _st_files(p: str) -> list[str]:
    from liferaft.tools.convert import _st_files as files

    return files(p)


def _check_safetensors(file: str, name: str, progress: Callable[[int], None] | None) -> tuple[int, list[str]]:
    """(bytes read, faults) of one safetensors file: a JSON header whose tensors have known dtypes and offsets
    that match their shapes, lie in the file and do not overlap; then every data byte read."""
    import json
    import struct

    from liferaft.tools.convert import FROM_ST
    from liferaft.transfer.tensors import torch_dtype

    size = os.path.getsize(file)
    faults: list[str] = []
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return 0, [f"file {name!r}: {size} bytes, shorter than a safetensors header; truncated"]
        (n,) = struct.unpack("<Q", head)
        try:
            if 8 + n > size:
                raise ValueError(f"the header says {n} bytes, the file has {size}")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return 0, [f"file {name!r}: the safetensors header cannot be read ({e}); damaged or truncated"]
        spans = []
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            try:
                a, b = (int(x) for x in spec["data_offsets"])
                want = torch.empty(0, dtype=torch_dtype(FROM_ST[spec["dtype"]])).element_size()
                for d in spec["shape"]:
                    want *= int(d)
            except (KeyError, TypeError, ValueError) as e:
                faults.append(f"file {name!r}: tensor {key!r}: a header entry liferaft cannot read ({e!r})")
                continue
            if b - a != want or a < 0:
                faults.append(f"file {name!r}: tensor {key!r}: offsets {a}..{b} for {want} bytes "
                              f"({spec['dtype']} {spec['shape']})")
            elif 8 + n + b > size:
                faults.append(f"file {name!r}: tensor {key!r}: its bytes end at {8 + n + b}, the file has {size}; "
                              "truncated")
            spans.append((a, b, key))
        spans.sort()
        for (a0, b0, k0), (a1, _, k1) in zip(spans, spans[1:]):
            if a1 < b0:
                faults.append(f"file {name!r}: tensors {k0!r} and {k1!r} overlap in the file")
        done = 0
        while True:                                 # every data byte read: I/O errors show
            piece = f.read(8 << 20)
            if not piece:
                break
            done += len(piece)
            if progress is not None:
                progress(len(piece))
    return done, faults
