"""The manifest and the commit marker read back: decoding and validation, and path safety.

This module is the on-disk contract (docs/FORMAT.md) together with ``format.records`` (the dataclasses and their
encoding, re-exported here). It imports neither torch nor other liferaft layers (only the leaf module
``liferaft.errors``). Decoding validates everything a reader relies on: the format version, types and ranges of
every number, and that every file name stays inside the checkpoint. It is linear in the size of the manifest:
the common tensor and chunk are checked in one pass (``_tensor_fast``, ``_chunk_fast``), anything else by the
full decoder, which names what is wrong.
"""

from __future__ import annotations

import itertools
import math
import posixpath
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from liferaft.errors import CorruptCheckpointError, FormatVersionError, UnsafePathError
from liferaft.format import jsonsafe
from liferaft.format.checks import tree_problem, value_depth
from liferaft.format.layout import COMMIT_MARKER, table_file_name
from liferaft.format.limits import (
    MAX_CHUNKS_PER_TENSOR,
    MAX_INT,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_NESTING,
    MAX_UNIX_TIME,
    MAX_WORLD_SIZE,
    MIN_CHUNK_BYTES,
    MIN_CHUNK_RECORD_BYTES,
    name_bytes,
)
from liferaft.format.records import (  # the manifest's data (re-exported: its home before records.py)
    CHECKSUM_ALGO,  # noqa: F401  (re-exported)
    CHECKSUM_ALGOS,
    CHUNK_DIGEST,
    CONTAINER_KINDS,
    DTYPE_ITEMSIZE,
    FORMAT_NAME,
    FORMAT_VERSION,
    KIND_HOLDS,
    LEGACY_CHECKSUM,
    TENSOR_KINDS,
    ChunkRecord,
    CommitMarker,
    ContainerEntry,
    Manifest,
    PathPart,
    TableRef,
    TensorEntry,
    ValueEntry,
    incremental_file,
)


def check_relative_path(name: str, what: str = "file") -> str:
    """Return ``name`` if it is a safe relative POSIX path inside the checkpoint, else raise UnsafePathError."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"manifest {what} name {name!r} is not a non-empty string")
    if "\\" in name or "\x00" in name or name.startswith("/") or posixpath.isabs(name):
        raise UnsafePathError(f"manifest {what} path {name!r} is absolute or malformed; refusing to read outside the checkpoint")
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith("../") or norm == ".." or "/../" in f"/{norm}/":
        raise UnsafePathError(f"manifest {what} path {name!r} points outside the checkpoint; refusing to read it")
    if any(name_bytes(part) > MAX_NAME_BYTES for part in name.split("/")):
        raise UnsafePathError(f"manifest {what} path {name[:80]!r}... has a component longer than {MAX_NAME_BYTES} "
                              "bytes, which no file system holds; the manifest is damaged or crafted")
    return name


def check_chunk_file(name: str) -> str:
    """A chunk's data file: a safe path inside the checkpoint, or ``../<checkpoint>/<safe path>``, a file of a
    sibling checkpoint under the same root (an incremental save's reference, docs/FORMAT.md §4.2)."""
    if isinstance(name, str) and name.startswith("../"):
        sibling, _, rest = name[3:].partition("/")
        if sibling in ("", ".", "..") or not rest:
            raise UnsafePathError(f"manifest file path {name!r} points outside the checkpoint's root; refusing "
                                  "to read it")
        check_relative_path(sibling, "file")
        check_relative_path(rest, "file")
        return name
    return check_relative_path(name)


# ----------------------------------------------------------------------------------------------- decoding


def _fail(where: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {msg}; the checkpoint is damaged or not a liferaft checkpoint")


def _int(v: Any, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``v`` if it is an int (not a bool, not a float) in ``[lo, hi]``."""
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(where, f"expected an integer from {lo} to {hi}, got {v!r:.80}")
    return v


def _ints(v: Any, where: str, lo: int = 0, max_len: int = MAX_INT) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > max_len:
        raise _fail(where, f"expected a list of at most {max_len} integers, got {v!r:.80}")
    return tuple(_int(x, where, lo) for x in v)


def _product(sizes: tuple[int, ...], itemsize: int, where: str) -> int:
    """``itemsize`` × the product of ``sizes``, refused when it exceeds ``MAX_INT`` (no tensor holds that)."""
    n = itemsize
    for s in sizes:
        n *= s
        if n > MAX_INT:
            raise _fail(where, f"shape {list(sizes)} of {itemsize}-byte items holds more than 2**63 - 1 bytes")
    return n


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _fail(where, f"expected a string, got {v!r}")
    return v


def _hashes(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(h, str) for h in v):
        raise _fail(where, f"chunk hashes must be a list of hex strings, got {v!r:.80}")
    return tuple(v)


def _parts(v: Any, where: str, max_len: int = MAX_INT) -> tuple[PathPart, ...]:
    ok = type(v) is list and len(v) <= max_len
    if ok:
        for p in v:
            if type(p) is not str and not (type(p) is int and -MAX_INT <= p <= MAX_INT):
                ok = False
                break
    if not ok:
        raise _fail(where, f"expected a list of at most {max_len} str/int path parts, got {v!r:.80}")
    return tuple(v)


def _path(v: Any, where: str) -> tuple[PathPart, ...]:
    return _parts(v, where, MAX_NESTING)


def _check_version(doc: Mapping[str, Any], what: str) -> int:
    if doc.get("format") != FORMAT_NAME:
        raise _fail(what, f"format field is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("version")
    if type(version) is not int:
        raise _fail(what, f"version field is {version!r:.40}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{what} has format version {version}, but this liferaft reads versions up to {FORMAT_VERSION}; "
            "upgrade liferaft to read it")
    if version < 1:
        raise _fail(what, f"unknown format version {version}")
    return version


def _loads(data: bytes, what: str, max_bytes: int) -> dict[str, Any]:
    doc = jsonsafe.loads(data, what, max_bytes)
    if not isinstance(doc, dict):
        raise _fail(what, "top level is not an object")
    return doc


def decode_commit_marker(data: bytes) -> CommitMarker:
    doc = _loads(data, COMMIT_MARKER, MAX_MARKER_BYTES)
    version = _check_version(doc, COMMIT_MARKER)
    if doc.get("checksum") != LEGACY_CHECKSUM:
        raise _fail(COMMIT_MARKER, f"checksum algorithm {doc.get('checksum')!r} is not {LEGACY_CHECKSUM!r}")
    return CommitMarker(manifest=check_relative_path(_str(doc.get("manifest"), COMMIT_MARKER), "manifest"),
                        manifest_size=_int(doc.get("manifest_size"), COMMIT_MARKER),
                        manifest_hash=_str(doc.get("manifest_hash"), COMMIT_MARKER), version=version)


def _checksum(v: Any, where: str) -> str:
    """A block checksum algorithm's name, refused unless this liferaft verifies it."""
    if v not in CHECKSUM_ALGOS:
        raise CorruptCheckpointError(f"{where}: block checksum algorithm {v!r:.40} is unknown to this liferaft "
                                     f"(known: {', '.join(CHECKSUM_ALGOS)}); the checkpoint was written by a newer "
                                     "liferaft: upgrade liferaft to read it")
    return v


_HEX = frozenset("0123456789abcdef")


def _digest(v: Any, where: str) -> str | None:
    """A chunk's ``digest`` (16 lowercase hex digits), None when absent; anything else is refused."""
    if v is None:
        return None
    if type(v) is not str or len(v) != 16 or not _HEX.issuperset(v):
        raise _fail(where, f"chunk digest must be 16 lowercase hex digits ({CHUNK_DIGEST}), got {v!r:.40}")
    return v


def _decode_chunk(c: Any, where: str, ndim: int, files: Mapping[str, int], itemsize: int,
                  codecs: Collection[str] | None, algo: str = LEGACY_CHECKSUM, nested: bool = False) -> ChunkRecord:
    if not isinstance(c, dict):
        raise _fail(where, "chunk is not an object")
    delta = None
    if c.get("delta") is not None:
        if nested:
            raise _fail(where, "a delta chunk's base is itself a delta")
        delta = _decode_chunk(c["delta"], f"{where} (delta base)", ndim, files, itemsize, codecs, algo, nested=True)
    rec = ChunkRecord(
        offsets=_ints(c.get("offsets"), where), sizes=_ints(c.get("sizes"), where),
        file=check_chunk_file(_str(c.get("file"), where)), byte_offset=_int(c.get("byte_offset"), where),
        length=_int(c.get("length"), where), block_size=_int(c.get("block_size"), where, 1),
        hashes=_hashes(c.get("hashes"), where),
        codec=None if c.get("codec") is None else _str(c.get("codec"), where),
        frames=None if c.get("frames") is None else _ints(c.get("frames"), where), delta=delta,
        checksum=_checksum(c["checksum"], where) if "checksum" in c else algo, digest=_digest(c.get("digest"), where))
    if rec.stored_length > MAX_INT or rec.byte_offset + rec.stored_length > MAX_INT:
        raise _fail(where, "chunk's stored bytes end beyond 2**63 - 1")
    if delta is not None and (delta.offsets, delta.sizes, delta.block_size) != (rec.offsets, rec.sizes,
                                                                               rec.block_size):
        raise _fail(where, "a delta chunk's base must be the same box with the same block size")
    if len(rec.offsets) != ndim or len(rec.sizes) != ndim:
        raise _fail(where, f"chunk has {len(rec.offsets)}-d offsets / {len(rec.sizes)}-d sizes for a {ndim}-d tensor")
    nbytes = _product(rec.sizes, itemsize, where)
    if rec.length != nbytes:
        raise _fail(where, f"chunk length {rec.length} != {list(rec.sizes)} elements x {itemsize} bytes")
    if rec.block_size % itemsize:
        raise _fail(where, f"block size {rec.block_size} is not a multiple of the item size {itemsize}")
    if rec.file not in files:
        raise _fail(where, f"chunk refers to file {rec.file!r} that the manifest does not list")
    if rec.byte_offset + rec.stored_length > files[rec.file]:
        raise _fail(where, f"chunk [{rec.byte_offset}, +{rec.stored_length}) lies beyond the end of {rec.file!r}")
    nblocks = -(-rec.length // rec.block_size) if rec.length else 0
    if len(rec.hashes) != nblocks:
        raise _fail(where, f"chunk has {len(rec.hashes)} block hashes, expected {nblocks}")
    if rec.codec is not None and codecs is not None and rec.codec not in codecs:
        raise CorruptCheckpointError(f"{where}: chunk codec {rec.codec!r} is unknown to this liferaft (known: "
                                     f"{', '.join(codecs)}); the checkpoint was written by a newer liferaft or "
                                     "with a codec registered there: upgrade liferaft (or register that codec) "
                                     "to read it")
    if (rec.codec is None) != (rec.frames is None) or (rec.frames is not None and len(rec.frames) != nblocks):
        raise _fail(where, "an encoded chunk needs one frame length per hash block (and a raw chunk none)")
    return rec


_INT = {int}
_STR = {str}
_new = object.__new__


def _raw_chunk(offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, byte_offset: int, length: int,
               block_size: int, hashes: tuple[str, ...], algo: str, digest: str | None = None) -> ChunkRecord:
    """``ChunkRecord(...)`` of a raw chunk (no codec, no delta), built without the frozen dataclass's per-field
    ``object.__setattr__`` (a third of the decoding time of a manifest of small tensors); the same object."""
    rec = _new(ChunkRecord)
    d = rec.__dict__
    d["offsets"], d["sizes"], d["file"], d["byte_offset"], d["length"] = offsets, sizes, file, byte_offset, length
    d["block_size"], d["hashes"], d["codec"], d["frames"], d["delta"] = block_size, hashes, None, None, None
    d["checksum"], d["digest"] = algo, digest
    return rec


def _plain_tensor(key: str, path: tuple[PathPart, ...], kind: str, dtype: str, shape: tuple[int, ...],
                  chunks: tuple[ChunkRecord, ...]) -> TensorEntry:
    """``TensorEntry(...)`` without ``lossy`` and ``per_rank``, built as ``_raw_chunk`` builds a chunk."""
    entry = _new(TensorEntry)
    d = entry.__dict__
    d["key"], d["path"], d["kind"], d["dtype"], d["shape"], d["chunks"] = key, path, kind, dtype, shape, chunks
    d["lossy"] = d["per_rank"] = d["layout"] = d["boxes"] = None
    return entry


def _chunk_fast(c: Any, ndim: int, files: Mapping[str, int], itemsize: int, algo: str = LEGACY_CHECKSUM
                ) -> ChunkRecord | None:
    """The record of chunk object ``c`` in the common case (raw bytes of a file the manifest lists, no codec, no
    delta, no checksum of its own, a valid digest or none, no empty dimension) when it passes every check of
    ``_decode_chunk``; None for anything else, which
    ``_decode_chunk`` then decodes or refuses. A plain ``file in files`` stands for ``check_chunk_file``: every
    name in ``files`` passed it."""
    if type(c) is not dict:
        return None
    digest = c.get("digest")
    if len(c) != (7 if digest is None else 8) or digest is not None and not (
            type(digest) is str and len(digest) == 16 and _HEX.issuperset(digest)):
        return None
    offsets, sizes, file, hashes = c.get("offsets"), c.get("sizes"), c.get("file"), c.get("hashes")
    byte_offset, length, block_size = c.get("byte_offset"), c.get("length"), c.get("block_size")
    if not (type(offsets) is list and type(sizes) is list and len(offsets) == ndim == len(sizes)
            and type(byte_offset) is int and type(length) is int and type(block_size) is int
            and type(hashes) is list and type(file) is str):
        return None
    if ndim and not ({*map(type, offsets), *map(type, sizes)} == _INT and min(offsets) >= 0 and min(sizes) >= 1
                     and max(offsets) <= MAX_INT):
        return None
    n = itemsize                    # sizes >= 1: the product only grows, so its end bounds every partial one
    for s in sizes:
        n *= s
    end = files.get(file)
    if (end is None or n != length or byte_offset < 0 or byte_offset + length > end     # end <= MAX_INT
            or not 1 <= block_size <= MAX_INT or block_size % itemsize
            or len(hashes) != -(-length // block_size) or {*map(type, hashes)} != _STR):
        return None
    return _raw_chunk(tuple(offsets), tuple(sizes), file, byte_offset, length, block_size, tuple(hashes), algo,
                      digest)


def _tensor_fast(t: dict[str, Any], files: Mapping[str, int], codecs: Collection[str] | None,
                 name: str, algo: str = LEGACY_CHECKSUM) -> TensorEntry | None:
    """The entry of tensor object ``t`` in the common case (the six fields a save writes, a path of strings, a
    shape without empty dimensions) when it passes every check of ``_decode_tensor``; None for anything else.
    Its chunks go through ``_chunk_fast``, then ``_decode_chunk`` (a codec, a delta, or a problem to name)."""
    if len(t) != 6:
        return None
    key, path, kind, dtype, shape, chunks = (t.get("key"), t.get("path"), t.get("kind"), t.get("dtype"),
                                             t.get("shape"), t.get("chunks"))
    itemsize = DTYPE_ITEMSIZE.get(dtype) if type(dtype) is str else None
    if not (itemsize and type(key) is str and kind == "tensor"
            and type(path) is list and len(path) <= MAX_NESTING and type(chunks) is list
            and type(shape) is list and len(shape) <= MAX_NDIM):
        return None
    if path and {*map(type, path)} != _STR or shape and ({*map(type, shape)} != _INT or min(shape) < 1):
        return None
    n = itemsize
    for s in shape:
        n *= s
    if n > MAX_INT:
        return None
    ndim = len(shape)
    records = []
    for c in chunks:
        rec = _chunk_fast(c, ndim, files, itemsize, algo)
        if rec is None:
            rec = _decode_chunk(c, f"{name} tensor {key!r}", ndim, files, itemsize, codecs, algo)
        records.append(rec)
    return _plain_tensor(key, tuple(path), kind, dtype, tuple(shape), tuple(records))


#: The fields of a tensor's ``lossy`` record (docs/FORMAT.md) and the JSON types each may hold.
_LOSSY_FIELDS: dict[str, tuple[type, ...]] = {
    "method": (str,), "max_abs_error": (int, float), "mean_abs_error": (int, float), "max_change": (int, float),
    "chunks": (int,), "of_chunks": (int,), "from": (list,)}


def _lossy(lossy: Any, where: str) -> dict[str, Any] | None:
    """A tensor's ``lossy`` record, checked: an object with a ``method``; each field it shares with
    ``_LOSSY_FIELDS`` of its type (numbers finite, ``from`` a list of checkpoint names); other fields plain JSON
    scalars (shown as they are)."""
    if lossy is None:
        return None

    def fits(k: str, x: Any) -> bool:
        kinds = _LOSSY_FIELDS.get(k)
        if kinds is None:
            return x is None or type(x) in (str, int, bool) or (type(x) is float and math.isfinite(x))
        if type(x) is bool or not isinstance(x, kinds) or (type(x) is float and not math.isfinite(x)):
            return False
        return k != "from" or all(type(n) is str for n in x)

    if not (isinstance(lossy, dict) and isinstance(lossy.get("method"), str)
            and all(type(k) is str and fits(k, x) for k, x in lossy.items())):
        raise _fail(where, f"lossy must be an object with a method and fields of their types, got {lossy!r:.80}")
    return lossy


def _decode_tensor(t: dict[str, Any], name: str, files: Mapping[str, int], codecs: Collection[str] | None,
                   algo: str = LEGACY_CHECKSUM) -> TensorEntry:
    """The entry of tensor object ``t`` of manifest ``name``, every field checked (``_tensor_fast`` first);
    ``algo``: the manifest's block checksum, that of every chunk that names none."""
    fast = _tensor_fast(t, files, codecs, name, algo)
    if fast is not None:
        return fast
    key = _str(t.get("key"), f"{name} tensor")
    where = f"{name} tensor {key!r}"
    dtype = _str(t.get("dtype"), where)
    if dtype not in DTYPE_ITEMSIZE:
        raise _fail(where, f"unknown dtype {dtype!r}")
    kind = _str(t.get("kind", "tensor"), where)
    if kind not in TENSOR_KINDS:
        raise _fail(where, f"unknown kind {kind!r}")
    shape = _ints(t.get("shape"), where, max_len=MAX_NDIM)
    ndim = len(shape) - (t.get("per_rank") is not None)        # (values stored per rank: one row per rank)
    if kind in KIND_HOLDS and (dtype not in KIND_HOLDS[kind][0] or KIND_HOLDS[kind][1] not in (None, ndim)):
        raise _fail(where, f"a value of kind {kind!r} cannot be a {ndim}-d {dtype} tensor")
    _product(shape, DTYPE_ITEMSIZE[dtype], where)
    raw_chunks = t.get("chunks", [])
    if type(raw_chunks) is not list:
        raise _fail(where, f"chunks must be a list, got {type(raw_chunks).__name__}")
    chunks = tuple(_decode_chunk(c, where, len(shape), files, DTYPE_ITEMSIZE[dtype], codecs, algo)
                   for c in raw_chunks)
    lossy = _lossy(t.get("lossy"), where)
    per_rank = t.get("per_rank")
    if per_rank is not None:
        per_rank = _ints(per_rank, where)
        if not per_rank or not shape or shape[0] != len(per_rank) or len(set(per_rank)) != len(per_rank):
            raise _fail(where, f"per_rank {list(per_rank)} must name distinct ranks, one per index of the "
                               f"first dimension of shape {list(shape)}")
    return TensorEntry(key=key, path=_path(t.get("path"), where), kind=kind, dtype=dtype, shape=shape, chunks=chunks,
                       lossy=lossy, per_rank=per_rank, layout=_layout(t.get("layout"), where, len(shape)),
                       boxes=_boxes(t.get("boxes"), where, shape))


def _boxes(v: Any, where: str, shape: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] | None:
    """A tensor's explicit ``boxes`` (§4.6): ``[[rank, [offsets], [sizes]], ...]``, each a non-empty box inside the
    tensor, sorted by offsets; the ranks are checked against the world by ``_tables``, their tiling by
    ``core.commit.decode_verified``."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise _fail(where, f"boxes must be a list of [rank, offsets, sizes], got {type(v).__name__}")
    if len(v) > MAX_CHUNKS_PER_TENSOR:
        raise _fail(where, f"{len(v)} boxes, more than the {MAX_CHUNKS_PER_TENSOR} chunks a tensor may have")
    fast = _boxes_fast(v, shape)
    if fast is not None:
        out = fast
        if any(a[1] == b[1] for a, b in itertools.pairwise(out)):
            raise _fail(where, "two of its boxes start at the same offsets")
        return tuple(out)
    out = []
    for b in v:
        if not (isinstance(b, list) and len(b) == 3):
            raise _fail(where, f"a box must be [rank, offsets, sizes], got {b!r:.80}")
        rank = _int(b[0], f"{where} box rank")
        offs = _ints(b[1], f"{where} box offsets", 0, len(shape))
        sizes = _ints(b[2], f"{where} box sizes", 1, len(shape))
        if len(offs) != len(shape) or len(sizes) != len(shape) or any(
                o + n > s for o, n, s in zip(offs, sizes, shape)):
            raise _fail(where, f"box {b!r:.80} is not a non-empty box inside shape {list(shape)}")
        out.append((rank, offs, sizes))
    out.sort(key=lambda b: b[1])
    if any(a[1] == b[1] for a, b in itertools.pairwise(out)):
        raise _fail(where, "two of its boxes start at the same offsets")
    return tuple(out)


def _boxes_fast(v: list[Any], shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]] | None:
    """``_boxes`` of well-formed boxes, checked as arrays (a million boxes in about a second), sorted by offsets;
    None when any box is not plain (then ``_boxes`` checks each and names the bad one)."""
    nd = len(shape)
    if not all(type(b) is list and len(b) == 3 for b in v):
        return None
    ranks, offs, sizes = [b[0] for b in v], [b[1] for b in v], [b[2] for b in v]
    if not all(type(o) is list and len(o) == nd for o in offs) or not all(type(z) is list and len(z) == nd
                                                                          for z in sizes):
        return None
    if not {*map(type, ranks), *map(type, itertools.chain.from_iterable(offs)),
            *map(type, itertools.chain.from_iterable(sizes))} <= {int}:
        return None                                 # (bool, float, str, None, nested lists: named one by one)
    try:
        r = np.array(ranks, dtype=np.int64)
        o = np.array(offs, dtype=np.int64).reshape(len(v), nd)
        z = np.array(sizes, dtype=np.int64).reshape(len(v), nd)
    except OverflowError:
        return None
    dims = np.array(shape, dtype=np.int64)
    if (r < 0).any() or (o < 0).any() or (z < 1).any() or (o > dims).any() or (z > dims - o).any():
        # (dims - o ≥ 0 once o ≤ dims: no overflow, whatever the dims)
        return None
    order = np.lexsort(o.T[::-1]) if nd else np.arange(len(v))
    return [(ranks[i], tuple(offs[i]), tuple(sizes[i])) for i in order.tolist()]


def _layout(v: Any, where: str, ndim: int) -> tuple[Any, ...] | None:
    """A tensor's ``layout`` (§4.6): ``{"mesh": [n, ...], "shards": [dim or null, ...]}``, one shard per mesh
    dimension, each a dimension of the tensor, and optionally ``"order"``: the mesh dimensions in the order they
    split the tensor (a permutation), and ``"at"``: per mesh dimension null or the coordinate a replicating
    dimension is fixed at (the tensor of one pipeline stage); ``(mesh, shards, order, at)``, None when absent."""
    if v is None:
        return None
    if not isinstance(v, dict) or not {"mesh", "shards"} <= set(v) <= {"mesh", "shards", "order", "at"}:
        raise _fail(where, f"layout must be an object with mesh, shards and optionally order and at, got {v!r:.80}")
    mesh = _ints(v["mesh"], f"{where} layout mesh", 1, MAX_NDIM)
    shards = v["shards"]
    if not mesh or not isinstance(shards, list) or len(shards) != len(mesh) or not all(
            d is None or (type(d) is int and 0 <= d < ndim) for d in shards):
        raise _fail(where, f"layout needs one shard (a dimension below {ndim}, or null) per mesh dimension, got "
                           f"{v!r:.80}")
    _product(mesh, 1, f"{where} layout mesh")
    order = None
    if "order" in v:
        order = _ints(v["order"], f"{where} layout order", 0, len(mesh))
        if sorted(order) != list(range(len(mesh))):
            raise _fail(where, f"layout order {v['order']!r:.80} is not an order of the {len(mesh)} mesh dimensions")
    at = None
    if "at" in v:
        at = v["at"]
        if not isinstance(at, list) or len(at) != len(mesh) or not all(
                a is None or (type(a) is int and d is None and 0 <= a < n) for a, d, n in zip(at, shards, mesh)) \
                or all(a is None for a in at):
            raise _fail(where, f"layout at {at!r:.80} must fix, for some replicating mesh dimensions, a coordinate "
                               "of that dimension (null elsewhere)")
        at = tuple(at)
    return mesh, tuple(shards), order, at


def _tables(doc: Mapping[str, Any], name: str, version: int, save_id: str, world_size: int,
            files: Mapping[str, int], tensors: list[TensorEntry]) -> tuple[tuple[TableRef, ...], dict[str, int] | None]:
    """The chunk tables and planning options of a version 4 index (§4.6), checked against its files, world size
    and tensors (whose chunks the tables hold: none may be listed inline, and each layout covers the world)."""
    raw, planned = doc.get("tables"), doc.get("planned")
    if raw is None and planned is None:
        if any(t.layout is not None or t.boxes is not None for t in tensors):
            raise _fail(name, "a tensor records a layout or boxes, but the manifest has no chunk tables")
        return (), None
    if version < 4:
        raise _fail(name, f"chunk tables need format version 4, the manifest says {version}")
    if version < 5 and any(t.layout is not None and t.layout[3] is not None for t in tensors):
        raise _fail(name, f"a layout's at needs format version 5, the manifest says {version}")
    if version < 6 and any(incremental_file(f) for f in files):
        raise _fail(name, f"chunk tables of an incremental save (files of another checkpoint, or copied from one) "
                          f"need format version 6, the manifest says {version}")
    if not isinstance(raw, list):
        raise _fail(name, "tables must be a list of objects")
    if not isinstance(planned, dict) or set(planned) != {"alignment", "chunk_bytes"}:
        raise _fail(name, f"planned must be an object with alignment and chunk_bytes, got {planned!r:.80}")
    plan = {"alignment": _int(planned["alignment"], f"{name} planned alignment", 1),
            "chunk_bytes": _int(planned["chunk_bytes"], f"{name} planned chunk_bytes", MIN_CHUNK_BYTES)}
    refs, ranks = [], set()
    for r in raw:
        if not isinstance(r, dict) or set(r) != {"file", "rank", "hash", "chunks"}:
            raise _fail(name, f"a chunk table must be an object with file, rank, hash and chunks, got {r!r:.80}")
        rank = _int(r["rank"], f"{name} table", 0, world_size - 1)
        file = _str(r["file"], f"{name} table")
        if file != table_file_name(save_id, rank) or file not in files or rank in ranks:
            raise _fail(name, f"chunk table {file!r:.120} of rank {rank} is not {table_file_name(save_id, rank)!r}, "
                              "is not listed in files, or is not the only table of its rank")
        h = _str(r["hash"], f"{name} table {file!r}")
        if len(h) != 16 or not _HEX.issuperset(h):
            raise _fail(name, f"chunk table {file!r}: hash must be 16 lowercase hex digits, got {h!r:.40}")
        ranks.add(rank)
        count = _int(r["chunks"], f"{name} table {file!r}", 0, files[file] // MIN_CHUNK_RECORD_BYTES)
        refs.append(TableRef(file=file, rank=rank, hash=h, chunks=count))
    tabled = {r.file for r in refs}
    if len({t.boxes is None for t in tensors}) > 1:
        raise _fail(name, "some tensors record boxes and others a layout: an index describes every tensor one way")
    for t in tensors:
        if t.chunks and not t.held_whole:
            raise _fail(name, f"tensor {t.key!r} is sharded and lists chunks in a manifest whose sharded tensors' "
                              "chunks live in chunk tables")
        if any(c.file in tabled for c in t.chunks):
            raise _fail(name, f"tensor {t.key!r} has a chunk in a chunk table's file")
        if (t.layout is None) == (t.boxes is None):
            raise _fail(name, f"tensor {t.key!r} has {'both a layout and boxes' if t.layout else 'no layout'} in a "
                              "manifest whose chunks live in chunk tables (a reader finds a chunk's table from its "
                              "tensor's layout, or from its boxes)")
        if t.boxes is not None:
            if t.chunks:
                raise _fail(name, f"tensor {t.key!r} lists boxes and chunks inline")
            if any(r >= world_size or r not in ranks for r, _, _ in t.boxes):
                raise _fail(name, f"tensor {t.key!r}: a box names a rank beyond the world of {world_size} or "
                                  "without a chunk table")
            continue
        if math.prod(t.layout[0]) != world_size:
            raise _fail(name, f"tensor {t.key!r}: layout mesh {list(t.layout[0])} is not of {world_size} rank(s)")
    return tuple(sorted(refs, key=lambda r: r.rank)), plan


def decode_manifest(data: bytes, name: str = "manifest", codecs: Collection[str] | None = None) -> Manifest:
    """Parse and validate a manifest. Raises CorruptCheckpointError, FormatVersionError or UnsafePathError.

    ``codecs``: the names of the chunk codecs the reader knows (``codecs.registry.names()``; this layer does not
    import them): a chunk stored with another codec is refused naming the tensor. None: codec names are not
    checked here (a read then refuses an unknown one when it meets it).

    Linear in the size of the manifest; the cyclic garbage collector is held off meanwhile (``paused_gc``)."""
    with jsonsafe.paused_gc():
        return _decode_manifest(data, name, codecs)


def _decode_manifest(data: bytes, name: str, codecs: Collection[str] | None) -> Manifest:
    doc = _loads(data, name, MAX_MANIFEST_BYTES)
    version = _check_version(doc, name)
    algo = _checksum(doc.get("checksum"), name)
    if doc.get("byte_order", "little") != "little":
        raise _fail(name, f"byte order {doc.get('byte_order')!r} is not supported")
    for section in ("tensors", "values", "containers"):
        if not isinstance(doc.get(section) or [], list) or not all(isinstance(x, dict) for x in doc.get(section) or []):
            raise _fail(name, f"{section} is not a list of objects")
    created = doc.get("created_unix", 0.0)
    if type(created) not in (int, float) or not 0 <= created <= MAX_UNIX_TIME:
        raise _fail(name, f"created_unix {created!r:.40} is not a time (seconds since 1970, up to year 9999)")
    files_raw = doc.get("files")
    if not isinstance(files_raw, dict):
        raise _fail(name, "files is not an object")
    files = {check_chunk_file(k): _int(v, f"{name} files[{k!r}]") for k, v in files_raw.items()}
    tensors = [_decode_tensor(t, name, files, codecs, algo) for t in doc.get("tensors") or []]
    values = []
    for v in doc.get("values") or []:
        key = _str(v.get("key"), f"{name} value")
        per_rank = v.get("per_rank")
        if per_rank is not None and not isinstance(per_rank, list):
            raise _fail(f"{name} value {key!r}", "per_rank is not a list")
        for x in [v.get("value")] if per_rank is None else per_rank:
            if value_depth(x) > MAX_NESTING:
                raise _fail(f"{name} value {key!r}", f"the value nests more than {MAX_NESTING} levels deep")
        held = v.get("held")
        if held is not None:
            held = _ints(held, f"{name} value {key!r} held")
            if per_rank is None or list(held) != sorted(set(held)) or \
                    any(x is not None for r, x in enumerate(per_rank) if r not in held):
                raise _fail(f"{name} value {key!r}", "held must name the ranks whose per_rank item is not null, in "
                                                     "increasing order, and comes only with per_rank")
        values.append(ValueEntry(key=key, path=_path(v.get("path"), f"{name} value {key!r}"), value=v.get("value"),
                                 per_rank=None if per_rank is None else tuple(per_rank), held=held))
    containers = []
    for c in doc.get("containers") or []:
        kind = _str(c.get("kind"), f"{name} container")
        if kind not in CONTAINER_KINDS:
            raise _fail(name, f"unknown container kind {kind!r}")
        children = c.get("children")
        role, cls = c.get("role"), c.get("class")
        if role is not None and not isinstance(role, str) or cls is not None and not isinstance(cls, str):
            raise _fail(name, f"container role {role!r:.40} / class {cls!r:.80} is not a string")
        containers.append(ContainerEntry(path=_path(c.get("path"), f"{name} container"), kind=kind,
                                         children=None if children is None else _parts(children, f"{name} container"),
                                         role=role if isinstance(role, str) else None,
                                         cls=cls if isinstance(cls, str) else None))
    problem = tree_problem(tensors, values, containers)
    if problem:
        raise _fail(name, problem)
    extra = doc.get("extra") or {}
    world_size = _int(doc.get("world_size"), name, 1, MAX_WORLD_SIZE)
    for v in values:
        if v.per_rank is not None and len(v.per_rank) != world_size:
            raise _fail(f"{name} value {v.key!r}", f"holds {len(v.per_rank)} per-rank values for a save by "
                                                   f"{world_size} rank(s)")
        if v.held is not None and (not v.held or v.held[-1] >= world_size):
            raise _fail(f"{name} value {v.key!r}", f"held {list(v.held)[:8]} names no rank, or one beyond the "
                                                   f"{world_size} saving rank(s)")
    for t in tensors:
        if t.per_rank is not None and max(t.per_rank) >= world_size:
            raise _fail(f"{name} tensor {t.key!r}", f"per_rank names rank {max(t.per_rank)} of a save by "
                                                    f"{world_size} rank(s)")
    save_id = _str(doc.get("save_id"), name)
    tables, planned = _tables(doc, name, version, save_id, world_size, files, tensors)
    return Manifest(
        save_id=save_id, world_size=world_size, tables=tables, planned=planned,
        created_unix=float(doc.get("created_unix") or 0.0), liferaft_version=str(doc.get("liferaft_version", "")),
        torch_version=str(doc.get("torch_version", "")), files=files, tensors=tuple(tensors), values=tuple(values),
        containers=tuple(containers), extra=extra if isinstance(extra, dict) else {}, version=version)
