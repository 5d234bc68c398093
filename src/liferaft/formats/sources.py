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
import math
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from liferaft.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from liferaft.options import LoadOptions

FORMATS = ("liferaft", "dcp", "safetensors", "torch")
INDEX = "model.safetensors.index.json"
MAX_DIMS = 64                   # more dimensions than any tensor has (torch allows 64)
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
        from liferaft.core.commit import check_files, open_checkpoint
        from liferaft.core.read import decode_entry_value
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
        from liferaft.formats.dcp import DcpCheckpoint

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
                    size = _drain(member, progress)
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
        from liferaft.formats.dcp import DcpCheckpoint

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
                from liferaft.formats.dcp import _View

                r, cb, n, fs, nc = _check_zip(io.BufferedReader(_View(f, offset, length)), what, progress)
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


#: The largest safetensors header read (the ``safetensors`` package's own limit).
ST_HEADER_LIMIT = 100_000_000


def _drain(f: Any, progress: Callable[[int], None] | None) -> int:
    """Read ``f`` to its end in 8 MiB pieces (``progress`` told each piece's size); the bytes read."""
    done = 0
    while True:
        piece = f.read(8 << 20)
        if not piece:
            return done
        done += len(piece)
        if progress is not None:
            progress(len(piece))


def read_st_header(f: Any, name: str, size: int
                   ) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    """The one validator of a safetensors header, for every reader: ``f`` open at the start of a file of ``size``
    bytes (``name`` in messages). Returns ({key: (liferaft dtype, shape, begin, end)} with begin/end relative to
    the data, the data's offset in the file). Checked before anything is allocated from it: the 8-byte length
    (at most ``ST_HEADER_LIMIT`` and within the file), a UTF-8 JSON object without repeated keys, ``__metadata__`` a
    str → str object, each entry an object with a known ``dtype``, a ``shape`` of non-negative ints whose product
    stays far from overflowing, ``data_offsets`` two ints ``0 <= a <= b <= data size`` with ``b - a`` the
    tensor's bytes, no two tensors overlapping. CorruptCheckpointError naming the file and key otherwise
    (InvalidStateError for a well-formed dtype liferaft does not know)."""
    import json
    import struct

    from liferaft.core.chunks.dtypes import torch_dtype
    from liferaft.errors import InvalidStateError
    from liferaft.tools.convert import FROM_ST

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"file {name!r}: {why}; not a valid safetensors file (damaged, truncated or "
                                      "crafted)")
    head = f.read(8)
    if len(head) < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length; truncated")
    (n,) = struct.unpack("<Q", head)
    if n > ST_HEADER_LIMIT or 8 + n > size:
        raise bad(f"the header is said to take {n} bytes (at most {ST_HEADER_LIMIT}), the file has {size}; "
                  "truncated or damaged")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ValueError("a key appears twice in one object")
        return d
    try:
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("the file ended inside the header")
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:
        raise bad(f"the header cannot be read ({str(e)[:200]})") from e
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("its __metadata__ is not an object of strings")
    data = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}

    def is_int(x: Any) -> bool:
        return type(x) is int                                   # not bool, not float
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        what = f"tensor {key!r}"
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
            raise bad(f"{what}: its entry is not an object with dtype, shape and data_offsets")
        dt, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dt, str):
            raise bad(f"{what}: dtype {dt!r} is not a name")
        if dt not in FROM_ST:
            raise InvalidStateError(f"file {name!r}: tensor {key!r} has dtype {dt[:40]}, unknown to liferaft")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
            raise bad(f"{what}: shape {str(shape)[:100]} is not a list of at most {MAX_DIMS} non-negative integers")
        span = 1
        for d in shape:
            span *= max(d, 1)
            if span > 1 << 62:
                raise bad(f"{what}: shape {str(shape)[:100]} is absurdly large")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(x) for x in offsets):
            raise bad(f"{what}: data_offsets {str(offsets)[:100]} are not two integers")
        a, b = offsets
        itemsize = torch_dtype(FROM_ST[dt]).itemsize
        numel = math.prod(shape)
        if not 0 <= a <= b:
            raise bad(f"{what}: data_offsets {a}..{b} are not an ascending pair of positions")
        if b - a != numel * itemsize:
            raise bad(f"{what}: data_offsets {a}..{b} hold {b - a} bytes, its {dt} {shape} takes "
                      f"{numel * itemsize}")
        if b > data:
            raise bad(f"{what}: its bytes end at {8 + n + b}, the file has {size}; truncated")
        out[key] = (FROM_ST[dt], tuple(shape), a, b)
    spans = sorted((a, b, k) for k, (_, _, a, b) in out.items() if b > a)
    for (_, b0, k0), (a1, _, k1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise bad(f"tensors {k0!r} and {k1!r} overlap in the file")
    return out, 8 + n


def _check_safetensors(file: str, name: str, progress: Callable[[int], None] | None) -> tuple[int, list[str]]:
    """(bytes read, faults) of one safetensors file: its header validated (``read_st_header``: a fault is the
    first thing wrong there), then every data byte read."""
    from liferaft.errors import InvalidStateError
    from liferaft.tools.hf_folder import open_regular

    try:
        with open_regular(file, name, CorruptCheckpointError, what="file") as f:
            size = os.fstat(f.fileno()).st_size
            read_st_header(f, name, size)
            done = _drain(f, progress)                  # every data byte read: I/O errors show
    except (CorruptCheckpointError, InvalidStateError) as e:
        return 0, [str(e)]
    return done, []
