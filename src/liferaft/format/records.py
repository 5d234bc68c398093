"""The manifest and the commit marker as data: frozen dataclasses, the names and constants of the format, and
their JSON encoding (docs/FORMAT.md). ``format.manifest`` decodes and validates them (and re-exports every name
here). Imports nothing of liferaft and no torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT_NAME = "liferaft"


def incremental_file(name: str) -> bool:
    """Whether ``name`` (of a manifest's ``files``) is a file an incremental save adds: another checkpoint's
    (``../<sibling>/...``, §4.2) or one of chunks copied from another (``...-copies.bin``)."""
    return name.startswith("../") or name.endswith("-copies.bin")
FORMAT_VERSION = 6          # the newest version this code reads; a save uses 2 to 6 only when it needs it
#: (§4.1 encoded chunks, §4.5 tensors per rank, §4.6 chunk tables; 6: chunk tables of an incremental save)

#: The block checksum a save records for the chunks it writes (CRC-32C: hardware-computed and hashed without the
#: GIL, so a background save does not stall a Python training loop; docs/FORMAT.md §3.1).
CHECKSUM_ALGO = "crc32c"
#: The checksum of the chunks of manifests that name no other (every checkpoint before ``crc32c``), and the one
#: the commit marker pins the manifest with.
LEGACY_CHECKSUM = "xxh3_64"
#: Every block checksum this code verifies: a manifest or chunk naming another is refused (written by a newer
#: liferaft).
CHECKSUM_ALGOS = ("xxh3_64", "crc32c")
#: The chunk digest (``ChunkRecord.digest``): 64 bits over a whole chunk's raw bytes, what an incremental save's
#: "unchanged" verdict rests on for chunks whose block checksum is 32-bit (docs/FORMAT.md §3.1, §4.2).
CHUNK_DIGEST = "xxh3_64"

PathPart = str | int

# dtype names stored in the manifest (torch names without the "torch." prefix).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}

TENSOR_KINDS = ("tensor", "numpy", "bytes")
#: What a tensor of a kind other than "tensor" may be: a numpy array, of a dtype numpy has (what the save took
#: through ``torch.from_numpy``); bytes, as a 1-d uint8 tensor. (dtype names, number of dimensions or None: any)
KIND_HOLDS: dict[str, tuple[frozenset[str], int | None]] = {
    "numpy": (frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                         "uint32", "uint64", "bool", "complex64", "complex128"}), None),
    "bytes": (frozenset({"uint8"}), 1),
}
CONTAINER_KINDS = ("dict", "list", "tuple", "stateful")


@dataclass(frozen=True)
class ChunkRecord:
    """One stored box of a global tensor: ``sizes`` elements starting at ``offsets`` (row-major, raw bytes).

    The bytes live in ``file`` at ``[byte_offset, byte_offset + length)``. They are hashed in blocks of
    ``block_size`` bytes (the last one may be shorter); ``hashes[i]`` is the hex digest of block i by the
    algorithm ``checksum`` names (one of ``CHECKSUM_ALGOS``).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    length: int
    block_size: int
    hashes: tuple[str, ...]
    #: None: the bytes are stored raw. Else each hash block is stored as one frame of this codec, ``frames[i]``
    #: bytes long, back to back from ``byte_offset``; ``hashes`` stay those of the decoded (raw) blocks.
    codec: str | None = None
    frames: tuple[int, ...] | None = None
    #: When set, the decoded bytes are the XOR of this chunk's values with those of ``delta``, the record of the
    #: same box in an earlier checkpoint (never itself a delta): read both, XOR, then check ``hashes``.
    delta: ChunkRecord | None = None
    #: the block checksum algorithm of ``hashes`` (a chunk referenced from an older checkpoint keeps its own)
    checksum: str = CHECKSUM_ALGO
    #: ``CHUNK_DIGEST`` (16 hex digits) of the whole chunk's raw bytes (those ``hashes`` describe: decoded, the
    #: delta undone), or None (chunks written before it, lossy chunks): only a chunk with one, or whose blocks
    #: are hashed by a 64-bit ``checksum``, is ever taken as equal to other bytes (docs/FORMAT.md §4.2).
    digest: str | None = None

    @property
    def stored_length(self) -> int:
        """Bytes the chunk occupies in ``file``."""
        return self.length if self.frames is None else sum(self.frames)

    @property
    def is_reference(self) -> bool:
        """True when the bytes live in another checkpoint (an incremental save reused them)."""
        return self.file.startswith("../")

    def frame_span(self, first: int, end: int) -> tuple[int, int]:
        """(offset in the file, length) of the stored bytes of hash blocks ``[first, end)``."""
        if self.frames is None:
            lo = first * self.block_size
            return self.byte_offset + lo, min(end * self.block_size, self.length) - lo
        lo = sum(self.frames[:first])
        return self.byte_offset + lo, sum(self.frames[first:end])

    def to_json(self, default_checksum: str = CHECKSUM_ALGO) -> dict[str, Any]:
        """The chunk's JSON object; ``checksum`` only when it differs from the manifest's ``default_checksum``."""
        out = {"offsets": list(self.offsets), "sizes": list(self.sizes), "file": self.file,
               "byte_offset": self.byte_offset, "length": self.length, "block_size": self.block_size,
               "hashes": list(self.hashes)}
        if self.codec is not None:
            out["codec"] = self.codec
            out["frames"] = list(self.frames or ())
        if self.delta is not None:
            out["delta"] = self.delta.to_json(default_checksum)
        if self.checksum != default_checksum:
            out["checksum"] = self.checksum
        if self.digest is not None:
            out["digest"] = self.digest
        return out


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor (or a numpy array / bytes value stored as one) and the chunks that cover it."""

    key: str
    path: tuple[PathPart, ...]
    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]
    #: None when the stored values are exactly those saved; else what was lost and how much (docs/FORMAT.md
    #: §4.3): ``{"method": "q8-block" | "selective", ...}``.
    lossy: Mapping[str, Any] | None = None
    #: None for a tensor every rank held alike (or sharded); else the saving ranks whose copies differed, one per
    #: index of dimension 0: the stored shape is ``[len(per_rank), *shape of each copy]`` (docs/FORMAT.md §4.5)
    per_rank: tuple[int, ...] | None = None
    #: (version 4) how the saving ranks held it: ``(mesh, shards, order[, at])`` of a ``planning.layouts.Layout``
    #: whose ``shards`` are tensor dimensions or None (replicated), ``order`` None or the order the mesh
    #: dimensions split the tensor in, ``at`` None or the coordinate some replicating dimensions are fixed at
    #: (a pipeline stage's tensor); None when not recorded
    layout: tuple[Any, ...] | None = None
    #: (version 4, a tensor without a ``layout``) the boxes of its chunks, each ``(rank, offsets, sizes)``: the
    #: rank whose chunk table lists that chunk (a save whose ranks' boxes follow no layout: planned gathered)
    boxes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def held_whole(self) -> bool:
        """(Version 4) Its ``layout`` says every saving rank held it whole: its chunks are listed in the index."""
        return self.layout is not None and all(d is None for d in self.layout[1])

    @functools.cached_property
    def chunk_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first, end)``: int64 arrays (chunks × dimensions) of each chunk's first index and one past its last,
        for overlap queries over many chunks (``planning.load_plan``); computed once per entry."""
        first = np.array([c.offsets for c in self.chunks], dtype=np.int64).reshape(len(self.chunks), len(self.shape))
        sizes = np.array([c.sizes for c in self.chunks], dtype=np.int64).reshape(first.shape)
        return first, first + sizes

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    def to_json(self, default_checksum: str = CHECKSUM_ALGO, chunks: bool = True) -> dict[str, Any]:
        """The tensor's JSON object; ``chunks=False``: without its chunks (they live in chunk tables, §4.6)."""
        out = {"key": self.key, "path": list(self.path), "kind": self.kind, "dtype": self.dtype,
               "shape": list(self.shape), "chunks": [c.to_json(default_checksum) for c in self.chunks] if chunks else []}
        if self.layout is not None:
            out["layout"] = {"mesh": list(self.layout[0]), "shards": list(self.layout[1])}
            if self.layout[2] is not None:
                out["layout"]["order"] = list(self.layout[2])
            if len(self.layout) > 3 and self.layout[3] is not None:     # type: ignore[misc]
                out["layout"]["at"] = list(self.layout[3])              # type: ignore[misc]
        if self.boxes is not None:
            out["boxes"] = [[r, list(o), list(z)] for r, o, z in self.boxes]
        if self.lossy is not None:
            out["lossy"] = dict(self.lossy)
        if self.per_rank is not None:
            out["per_rank"] = list(self.per_rank)
        return out


@dataclass(frozen=True)
class ValueEntry:
    """A plain (non-tensor) value, encoded as tagged JSON (see ``liferaft.state.values``).

    ``per_rank`` is None when every rank held the same value (stored once in ``value``); otherwise it holds one
    encoded value per saving rank and ``value`` is None. ``held``: with ``per_rank``, the ranks that held the key
    when some did not (their items are null; None: every rank held it, or a checkpoint from before the field).
    """

    key: str
    path: tuple[PathPart, ...]
    value: Any = None
    per_rank: tuple[Any, ...] | None = None
    held: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "path": list(self.path)}
        if self.per_rank is None:
            out["value"] = self.value
        else:
            out["per_rank"] = list(self.per_rank)
            if self.held is not None:
                out["held"] = list(self.held)
        return out


@dataclass(frozen=True)
class ContainerEntry:
    """A dict / list / tuple / stateful object in the saved tree (so that empty containers survive).

    ``children`` lists the keys/indices under it in the order they were saved (None: unknown, sort them). A
    stateful object records what it was: ``role`` "module" (an ``nn.Module``: its subtree is a model's state dict,
    which exports take) or "optimizer", and ``cls`` its class ("transformers...BertModel"); both None in
    checkpoints written before they were recorded, and for other objects.
    """

    path: tuple[PathPart, ...]
    kind: str
    children: tuple[PathPart, ...] | None = None
    role: str | None = None
    cls: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": list(self.path), "kind": self.kind}
        if self.children is not None:
            out["children"] = list(self.children)
        if self.role is not None:
            out["role"] = self.role
        if self.cls is not None:
            out["class"] = self.cls
        return out


@dataclass(frozen=True)
class TableRef:
    """(Version 4) One rank's chunk table (docs/FORMAT.md §4.6): the file ``file`` (listed in the manifest's
    ``files`` with its size) holding the records of the ``chunks`` chunks of rank ``rank``'s data file, pinned
    by the ``LEGACY_CHECKSUM`` digest ``hash`` of its bytes."""

    file: str
    rank: int
    hash: str
    chunks: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rank": self.rank, "hash": self.hash, "chunks": self.chunks}


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs: entries, files and who wrote the checkpoint."""

    save_id: str
    world_size: int
    created_unix: float
    liferaft_version: str
    torch_version: str
    files: Mapping[str, int]
    tensors: tuple[TensorEntry, ...]
    values: tuple[ValueEntry, ...]
    containers: tuple[ContainerEntry, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    version: int = 1
    #: (version 4) the chunk tables holding every chunk record, by rank (docs/FORMAT.md §4.6); empty: the chunks
    #: are listed in ``tensors``. A manifest read back with tables has its tensors' chunks filled from them.
    tables: tuple[TableRef, ...] = ()
    #: (version 4) ``{"alignment": int, "chunk_bytes": int}``: the options the writes were planned with from the
    #: tensors' layouts (``planning.layouts.plan_own``), so that a reader can tell which rank wrote which box
    planned: Mapping[str, int] | None = None

    @property
    def tabled(self) -> bool:
        """(Version 4) Its sharded tensors' chunks live in chunk tables (``planned`` is set; ``tables`` may be
        empty when no rank wrote a chunk of a sharded tensor)."""
        return self.planned is not None

    def needs_version(self) -> int:
        """The lowest format version that describes this manifest: 6 when its chunks live in chunk tables and some
        lie in another checkpoint or in a file of chunks copied from one (an incremental save, §4.2); 5 when its
        chunks live in chunk tables and a
        layout is scoped to a slice of the ranks (``at``: pipeline stages); 4 when its chunks live in chunk
        tables; 3 when a tensor is stored per rank; 2 when a chunk is encoded or lives in another checkpoint, or
        an entry is lossy; else 1 (readable by liferaft versions that predate them)."""
        if self.tabled:
            if any(incremental_file(f) for f in self.files):
                return 6
            return 5 if any(t.layout is not None and len(t.layout) > 3 and t.layout[3] is not None
                            for t in self.tensors) else 4
        if any(t.per_rank is not None for t in self.tensors):
            return 3
        for t in self.tensors:
            if t.lossy is not None or any(c.codec is not None or c.is_reference or c.delta is not None
                                          for c in t.chunks):
                return 2
        return 1

    @property
    def lossy(self) -> bool:
        return any(t.lossy is not None for t in self.tensors)

    def default_checksum(self) -> str:
        """The manifest's ``checksum``: ``LEGACY_CHECKSUM`` when every chunk uses it (the manifest is then what
        liferaft wrote before per-chunk algorithms, byte for byte), else ``CHECKSUM_ALGO`` — which a liferaft
        that predates per-chunk algorithms refuses by name rather than mistaking the hashes for damage."""
        for t in self.tensors:
            for c in t.chunks:
                if c.checksum != LEGACY_CHECKSUM or (c.delta is not None and c.delta.checksum != LEGACY_CHECKSUM):
                    return CHECKSUM_ALGO
        return LEGACY_CHECKSUM

    def to_json_bytes(self) -> bytes:
        """The manifest's bytes; with ``tables``, the sharded tensors are written without their chunks (the index
        of §4.6: their chunks are in the tables)."""
        algo = self.default_checksum() if not self.tabled else CHECKSUM_ALGO
        doc = {
            "format": FORMAT_NAME, "version": max(self.version, self.needs_version()), "save_id": self.save_id,
            "world_size": self.world_size, "created_unix": self.created_unix,
            "liferaft_version": self.liferaft_version, "torch_version": self.torch_version,
            "checksum": algo, "byte_order": "little", "files": dict(sorted(self.files.items())),
            "tensors": [t.to_json(algo, chunks=not self.tabled or t.held_whole) for t in self.tensors],
            "values": [v.to_json() for v in self.values],
            "containers": [c.to_json() for c in self.containers], "extra": dict(self.extra),
        }
        if self.tabled:
            doc["tables"] = [r.to_json() for r in self.tables]
            doc["planned"] = dict(self.planned or {})
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {t.key: t for t in self.tensors}


@dataclass(frozen=True)
class CommitMarker:
    """The last object written: names the manifest and pins its size and checksum."""

    manifest: str
    manifest_size: int
    manifest_hash: str
    version: int = FORMAT_VERSION

    def to_json_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT_NAME, "version": self.version, "manifest": self.manifest,
                           "manifest_size": self.manifest_size, "manifest_hash": self.manifest_hash,
                           "checksum": LEGACY_CHECKSUM}).encode()
