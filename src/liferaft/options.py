"""The options objects and result types of the public API, and the names of the choices their string options take
(``Literal`` types, so that a type checker catches ``compression="yes"`` before the run does)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from liferaft.errors import OptionsError
from liferaft.format.limits import MAX_NESTING, MIN_CHUNK_BYTES
from liferaft.planning.references import DEFAULT_MIN_SHARE
from liferaft.planning.save_plan import DEFAULT_CHUNK_BYTES
from liferaft.storage.base import MAX_READ_BYTES, MIN_READ_BYTES

#: ``SaveOptions.compression``: lossless compression where it pays ("auto"), always ("on") or never ("off").
Compression = Literal["auto", "on", "off"]
#: ``SaveOptions.staging`` (``async_save``): return once the snapshot is taken, or at once (copy in the background).
Staging = Literal["blocking", "overlapped"]
#: ``SaveOptions.if_busy``: what a save does while an ``async_save`` of this process is in flight.
IfBusy = Literal["wait", "skip", "raise"]
#: The formats ``liferaft.convert`` reads and writes ("hf": a Hugging Face model folder, written as safetensors).
ConvertFormat = Literal["liferaft", "safetensors", "hf", "torch", "dcp"]
#: ``liferaft.gc`` (and the manager's retention) with ``keep_best``: the best metric is the smallest or the largest.
MetricMode = Literal["min", "max"]

_O = TypeVar("_O")


#: Longest ``timeout`` (seconds) an option takes: 30 days (collectives take it as a ``timedelta`` in milliseconds).
MAX_TIMEOUT = 30 * 86400.0
#: Largest byte count any size option takes (chunk_bytes, memory_budget, block_size, alignment): 1 PiB.
MAX_BYTES = 1 << 50


def check_int(owner: str, name: str, value: object, low: int, high: int = MAX_BYTES, *,
              none: bool = False) -> None:
    """OptionsError unless ``value`` is an int (not a bool) in ``[low, high]`` (or None, with ``none``)."""
    if value is None and none:
        return
    if type(value) is not int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise OptionsError(f"{owner}.{name} must be an integer{' or None' if none else ''}, got {shown(value)}")
    if not low <= value <= high:
        raise OptionsError(f"{owner}.{name} must be between {low} and {high}, got {value}")


def check_number(owner: str, name: str, value: object, low: float, high: float = math.inf, *,
                 above: bool = False, none: bool = False) -> None:
    """OptionsError unless ``value`` is a finite int or float (not a bool, not a string) in ``[low, high]``
    (``above``: ``> low``), or None with ``none``."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionsError(f"{owner}.{name} must be a number{' or None' if none else ''}, got {shown(value)}")
    if not math.isfinite(value) or value < low or (above and value == low) or value > high:
        bound = f"greater than {low:g}" if above else f"at least {low:g}"
        raise OptionsError(f"{owner}.{name} must be a finite number {bound}"
                           + (f" and at most {high:g}" if math.isfinite(high) else "") + f", got {shown(value)}")


def check_bool(owner: str, name: str, value: object, *, none: bool = False) -> None:
    """OptionsError unless ``value`` is True or False (or None, with ``none``)."""
    if not isinstance(value, bool) and not (none and value is None):
        raise OptionsError(f"{owner}.{name} must be True or False{' (or None)' if none else ''}, got {shown(value)}")


def check_patterns(owner: str, name: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple of glob strings (one string is one pattern); OptionsError for anything else."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise OptionsError(f"{owner}.{name} must be a glob pattern or a list of non-empty glob patterns, got {shown(value)}")



def shown(value: object, limit: int = 80) -> str:
    """A user's value as an error message echoes it: its type (but for a plain str, number, bool, None) and a repr cut to about ``limit`` characters, built
    without the full repr of a large container (``reprlib``), so a 100k-key dict passed by mistake prints a line."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 2, 4, 4, 4, 4
    r.maxstring = r.maxother = limit
    text = r.repr(value)
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    if value is None or type(value) in (str, int, float, bool):     # (short plain values: as they are)
        return text
    return f"{type(value).__qualname__} {text}"


def check_path(path: object, what: str = "path", *, storage: bool = True) -> None:
    """OptionsError unless ``path`` is a non-empty ``str`` or ``os.PathLike`` of ``str`` (or, with ``storage``, a
    ``liferaft.storage.Storage``): what every API entry taking a checkpoint or root path checks first (bytes,
    numbers, None and "" are refused, naming ``what``)."""
    from liferaft.storage import Storage

    if storage and isinstance(path, Storage):
        return
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(s, str):
        raise OptionsError(f"{what} must be a str path, a URL{' or a liferaft.storage.Storage' if storage else ''}"
                           f", got {shown(path)}")
    if not s:
        raise OptionsError(f"{what} is empty: give the path of a checkpoint (or root) folder or a URL")
    if "\x00" in s:
        raise OptionsError(f"{what} holds a NUL character: {shown(s)}")


def check_options(value: Any, cls: type[_O], where: str) -> _O:
    """``value`` when it is a ``cls`` (the default ``cls()`` for None); OptionsError, saying what to pass, for
    anything else (a dict of options, another options class)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise OptionsError(f"{where}: options= must be a liferaft.{cls.__name__} (or None), got "
                           f"{type(value).__qualname__}; pass options=liferaft.{cls.__name__}(...) — e.g. "
                           f"{cls.__name__}(**your_dict) for a dict of its fields")
    return value


def _check_choice(owner: str, name: str, value: object, choices: Any) -> None:
    """OptionsError unless ``value`` is one of the ``Literal`` type ``choices``."""
    allowed = get_args(choices)
    if value not in allowed:
        said = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise OptionsError(f"{owner}.{name} must be {said}, got {shown(value)}")


@dataclass(frozen=True)
class SaveOptions:
    """How to save. Every field is checked on construction (OptionsError naming it): bools are bools, sizes ints
    (not bools, not floats), numbers finite ints or floats, patterns strings, choices one of their names.

    overwrite: replace a committed checkpoint at the path. The old one stays loadable until the new one is
        committed; there is never a mix of the two.
    allow_pickle: store values that are not plain data with pickle (loading them needs allow_pickle too).
    timeout: seconds any rank waits for the others at each step before raising DistributedError (a finite number
        > 0, at most 30 days).
    block_size: bytes per checksum block (a resharding load reads and verifies whole blocks); None (default)
        picks per chunk about 1/64 of its size, as a power of two between 64 KiB and 4 MiB.
    alignment: byte alignment of every chunk in the data files.
    metadata: JSON-compatible data stored in the manifest as ``extra`` (e.g. the training step).
    memory_budget: bytes of host memory a save may use for staging (a buffer pool kept and reused across saves).
        ``async_save``: None (default) means as much as this rank writes, so the snapshot is taken in one go; a
        smaller budget takes it in waves: the stall grows, memory does not. ``save``: a ring of 64 MiB, or the
        budget if smaller.
    staging: ``async_save`` only. "blocking" (default): return once the snapshot is taken, after which the state
        may change freely. "overlapped": return at once and copy in the background; call
        ``handle.wait_staged()`` before changing any tensor of the state (e.g. right before ``optimizer.step()``).
    if_busy: what a save does while an ``async_save`` of this process is still in flight: "wait" for it (default),
        "skip" this save (``save`` and ``async_save`` return None, on every rank), or "raise" CheckpointBusyError
        (on every rank).
    compression: "auto" (default), "on" or "off". Lossless: each chunk's hash blocks are stored as byte-plane +
        zstd frames where a sample block shrinks (else the chunk is stored raw), encoded on worker threads.
        "auto" compresses for remote storage (object stores) always, and for local storage only when
        ``storage_write_bps`` is given and the codec threads encode at least that fast (else raw): a function of
        the options and the storage's kind alone, never of earlier saves (``codecs.advisor``). Loads decode
        whatever they find.
    storage_write_bps: the local storage's write throughput in bytes/s, as the caller knows or measured it (e.g.
        ``bytes_written / timings["write"]`` of an earlier raw save); only ``compression="auto"`` uses it.
    chunk_bytes: largest chunk written; larger boxes are cut into row-major runs of at most this size (the unit
        an incremental save can skip, and of load balancing between ranks).
    incremental_base: name of a committed checkpoint next to this one (same parent folder or prefix, e.g.
        "step-0000000100"): a chunk whose bytes equal that checkpoint's chunk of the same box is not written
        again; the manifest references it (``../<base>/data/...``). The base must then not be deleted or
        overwritten while this checkpoint is kept (``CheckpointManager`` takes care of that). A base that
        cannot be opened is skipped with a warning (the save is then a full one).
    reference_min_share: an incremental save references an older checkpoint only when the unchanged chunks it
        holds are at least this share of the save's tensor bytes (default 0.1); below it, those few chunks are
        copied into the new checkpoint (read from the old one and verified), which then does not depend on the
        old one, so retention can delete it. Decided once all ranks have written, the same on every rank; the
        base of an XOR ``delta`` stays referenced. 0: reference every unchanged chunk, however few.
    quantize: glob patterns of tensor keys (e.g. ``"optim.state.*.exp_avg*"``) stored lossily as 8-bit values
        with a float32 scale per 256 (codec ``q8-block``; floating-point tensors with finite values only). Never
        the default; the manifest records the codec and the max/mean absolute error, loads warn, and
        ``LoadOptions(exact=True)`` refuses such a checkpoint.
    delta: glob patterns of tensor keys (e.g. ``"optim.state.*"``) stored, in an incremental save, as the XOR of
        their bytes with the base's bytes of the same chunk, then compressed (lossless: slowly changing values
        share sign, exponent and high mantissa bits, so the XOR is mostly zeros). Costs a read of the base's
        chunk at save time and at load time; deltas are always taken against a chunk stored whole (the base's
        own, or the one the base's delta refers to), so a load reads at most two chunks per box.
    selective: lossy, opt-in (LLMTailor-style selective checkpoints), for incremental saves: a floating-point chunk
        of a key matching ``selective_keys`` whose relative change ‖x − x_base‖ / ‖x_base‖ against the values the
        base stores for it is below this threshold is not written; the base's chunk is referenced, so a load
        composes the state from several steps. The tensor's manifest entry says how many chunks came from which
        checkpoint and the largest change left out; ``LoadOptions(exact=True)`` refuses such a checkpoint. Costs
        a read of the base's chunks at save time.
    chunk_tables: (default True) when some tensor is sharded over several ranks and nothing is lossy, each
        writing rank stores the records of its chunks in a table file beside its data file and the manifest
        becomes an index (format version 4, docs/FORMAT.md §4.6): with the tensors' layouts when the ranks plan
        their writes on their own (DTensors over one mesh of every rank, hand-made shards that follow such a
        layout, plain tensors alike on every rank: ``planning.layouts``; rank 0 then receives a few bytes per
        rank to commit instead of every chunk's record), else with every chunk's box and rank (explicit boxes;
        not for an incremental save). A loading rank reads only the tables of the ranks whose boxes it needs.
        Every rank must pass the same value. False: one manifest lists every chunk (version 1 to 3, readable by
        liferaft before 4).
    """

    overwrite: bool = False
    allow_pickle: bool = False
    timeout: float = 600.0
    block_size: int | None = None
    alignment: int = 64
    metadata: Mapping[str, Any] = field(default_factory=dict)
    memory_budget: int | None = None
    staging: Staging = "blocking"
    if_busy: IfBusy = "wait"
    compression: Compression = "auto"
    storage_write_bps: float | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    incremental_base: str | None = None
    reference_min_share: float = DEFAULT_MIN_SHARE
    quantize: tuple[str, ...] = ()
    delta: tuple[str, ...] = ()
    selective: float | None = None
    selective_keys: tuple[str, ...] = ("*",)
    chunk_tables: bool = True

    def __post_init__(self) -> None:
        o = "SaveOptions"
        for name in ("overwrite", "allow_pickle", "chunk_tables"):
            check_bool(o, name, getattr(self, name))
        check_number(o, "timeout", self.timeout, 0, MAX_TIMEOUT, above=True)
        _check_choice(o, "compression", self.compression, Compression)
        check_number(o, "storage_write_bps", self.storage_write_bps, 0, above=True, none=True)
        check_int(o, "chunk_bytes", self.chunk_bytes, MIN_CHUNK_BYTES)
        check_int(o, "memory_budget", self.memory_budget, 1 << 20, none=True)
        check_int(o, "block_size", self.block_size, 16, none=True)
        check_int(o, "alignment", self.alignment, 1, 1 << 30)
        check_number(o, "reference_min_share", self.reference_min_share, 0, 1)
        check_number(o, "selective", self.selective, 0, above=True, none=True)
        for name in ("quantize", "delta", "selective_keys"):
            object.__setattr__(self, name, check_patterns(o, name, getattr(self, name)))
        if not isinstance(self.metadata, Mapping):
            raise OptionsError(f"SaveOptions.metadata must be a dict of JSON data, got {shown(self.metadata)}")
        if self.incremental_base is not None and not isinstance(self.incremental_base, str):
            raise OptionsError(f"SaveOptions.incremental_base must be the name of a checkpoint (a str) or None, got "
                               f"{shown(self.incremental_base)}")
        if self.incremental_base is not None and (not self.incremental_base or "/" in self.incremental_base
                                                  or self.incremental_base in (".", "..")):
            raise OptionsError(f"SaveOptions.incremental_base must be the name of a checkpoint in the same folder "
                               f"(no '/'), got {shown(self.incremental_base)}")
        _check_choice("SaveOptions", "staging", self.staging, Staging)
        _check_choice("SaveOptions", "if_busy", self.if_busy, IfBusy)
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            raise OptionsError(f"SaveOptions.block_size must be a positive multiple of 16, got {self.block_size}")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise OptionsError(f"SaveOptions.alignment must be a power of two, got {self.alignment}")
        if _depth(self.metadata) > MAX_NESTING:     # (a manifest a reader would refuse is never written)
            raise OptionsError(f"SaveOptions.metadata nests more than {MAX_NESTING} levels of lists and dicts")
        bad = _non_str_key(self.metadata)           # (json.dumps would turn 1 into "1" silently)
        if bad is not None:
            raise OptionsError(f"SaveOptions.metadata must be plain JSON data (str keys, numbers, strings, lists, "
                               f"dicts): the key {bad!r} is a {type(bad).__name__}, not a str")
        try:
            json.dumps(dict(self.metadata), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise OptionsError(f"SaveOptions.metadata must be plain JSON data (str keys, numbers, strings, lists, "
                               f"dicts): {e}") from None


@dataclass(frozen=True)
class LoadOptions:
    """How to load.

    allow_pickle: trust and unpickle pickled values.
    timeout: seconds any rank waits for the others at each step, as for save (finite, > 0, at most 30 days).
    max_read_bytes: largest single read, i.e. each scratch buffer a load allocates (4 KiB to 64 GiB). None
        (default): the storage's ``read_size`` (local disk 8 MiB, measured, see
        ``storage.posix.DISK_READ_SIZE``; at most ``core.chunks.shm.SHARED_READ_SIZE`` on several ranks; RAM 4 MiB; object stores 32 MiB, split into parallel requests).
    atomic: read and verify every byte on every rank before any byte is copied into the state, so that even a
        checksum failure leaves the state untouched; costs a second read of the data (usually from the page
        cache). Without it, a checksum failure still stops the load before the bad bytes land, but tensors
        filled earlier already hold loaded values. Formats without checksums (DCP, safetensors, torch.save)
        have nothing more to verify: every check they allow (files present and long enough, headers, each DCP
        chunk's blob opened) runs before any byte is copied, with or without ``atomic``. Either way, a stateful
        object whose own ``load_state_dict`` fails on one rank leaves what was applied before it applied.
    share_reads: when several ranks need the same byte range (replicated tensors, or resharding that makes
        every rank read the same hash blocks), one rank reads it from storage and the others get it, so each byte
        is read from storage once. On remote storage (``Storage.remote``) it is sent over the process group
        (received bytes are verified too). On local files the ranks of one host share it through shared memory
        (``/dev/shm``, a per-load segment per rank that reads shared spans, 2 slots sized to what it reads and
        at most ``max_read_bytes`` each, unlinked once opened): one rank reads, decodes and verifies it, the others
        copy their boxes from it; each rank reads runs of adjacent spans, of any size, with one request and tells
        the others about a run with one message; ranks on other hosts read for themselves; a span larger than
        ``max_read_bytes`` is read by each rank. Over the process group a span below 1 MiB is read by each rank
        (one message per span). The segment is reserved whole
        before use: where it does not fit (a small ``/dev/shm``, e.g. Docker's 64 MiB default) the load warns and
        every rank reads for itself. A rank copies shared bytes only into chunks whose record (codec, frames,
        delta, hashes) is the one they were verified against. None (default): on, without the warning (local
        files without a shared-memory folder: each rank reads for itself; over loopback sending was slower);
        True: on, also over the process group for local files without a shared-memory folder; False: every rank
        reads for itself.
    exact: refuse (LossyCheckpointError, before anything is loaded) a checkpoint in which any tensor to load was
        stored lossily (``SaveOptions.quantize``); without it such a load warns with the recorded error per key
        and lists them in ``LoadResult.lossy``.
    ignore_keys: checkpoint keys that the state does not hold and that a strict load then leaves unread instead of
        refusing them as unexpected — each a key or a prefix of the dotted key strings (``"dataloader"`` covers
        ``dataloader`` and every ``dataloader.*``, including a key whose own name holds dots). It only tolerates:
        a named key the state does hold is loaded as usual (to skip loading something, leave it out of the state),
        and a key of the state missing from the checkpoint is refused as before. Still listed in
        ``LoadResult.unexpected_keys``.
    """

    allow_pickle: bool = False
    exact: bool = False
    atomic: bool = False
    share_reads: bool | None = None
    timeout: float = 600.0
    max_read_bytes: int | None = None
    ignore_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        o = "LoadOptions"
        for name in ("allow_pickle", "exact", "atomic"):
            check_bool(o, name, getattr(self, name))
        check_bool(o, "share_reads", self.share_reads, none=True)
        check_number(o, "timeout", self.timeout, 0, MAX_TIMEOUT, above=True)
        check_int(o, "max_read_bytes", self.max_read_bytes, MIN_READ_BYTES, MAX_READ_BYTES, none=True)
        if type(self.ignore_keys) is not tuple or not all(type(k) is str and k for k in self.ignore_keys):
            raise OptionsError(f"{o}.ignore_keys must be a tuple of non-empty key strings, got "
                               f"{self.ignore_keys!r}")

    def ignores(self, key: str) -> bool:
        """Whether ``key`` of a checkpoint is one ``ignore_keys`` names (itself, or under it)."""
        return any(key == k or key.startswith(k + ".") for k in self.ignore_keys)


@dataclass(frozen=True)
class SaveResult:
    """What a save did. ``timings`` holds seconds per phase on this rank: plan, stage, write, commit, total,
    for ``async_save`` also ``blocked`` (how long the call held the caller), and ``copy`` when an incremental save
    copied chunks rather than reference them (``SaveOptions.reference_min_share``; they count in
    ``bytes_written``, not in ``bytes_reused``)."""

    path: str
    save_id: str
    world_size: int
    rank: int
    bytes_written: int          # by this rank
    total_bytes: int            # by all ranks
    files: int                  # data files in the checkpoint
    timings: Mapping[str, float]
    staging_bytes: int = 0      # host memory of the staging buffer pool this save used
    bytes_reused: int = 0       # by this rank: raw bytes of chunks referenced in the incremental base, not written
    bytes_encoded: int = 0      # by this rank: raw bytes of the chunks it stored encoded (compressed or lossy)


@dataclass(frozen=True)
class LoadResult:
    """What a load did. Keys missing from the checkpoint or unexpected in it are listed (strict=False).
    ``timings``: seconds of plan, verify (the first pass of an atomic load), read (reading, verifying and copying,
    pipelined), checksum (the time spent hashing within read), apply, total."""

    path: str
    rank: int
    bytes_read: int             # by this rank: the bytes its tensors were filled from (verified)
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    timings: Mapping[str, float]
    bytes_received: int = 0     # of bytes_read, those a peer read and sent (LoadOptions.share_reads)
    lossy: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)   # key -> how it was stored lossily
    #: keys of the checkpoint naming buffers the state's modules do not persist (``persistent=False``): not
    #: loaded, and not "unexpected" (``liferaft.state.matching``)
    skipped_keys: tuple[str, ...] = ()
    #: chunk tables this rank read (format version 4, docs/FORMAT.md §4.6: those of the ranks that wrote the
    #: boxes it loads; None: the checkpoint has none)
    tables_read: int | None = None


def _non_str_key(v: Any) -> Any:
    """The first key of a dict in ``v`` (lists and dicts walked, without recursion, at most ``MAX_NESTING`` deep:
    ``_depth`` refuses deeper ones first) that is not a str; None if there is none."""
    todo = [(v, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, Mapping):
            for k in x:
                if not isinstance(k, str):
                    return k
            items: Any = x.values()
        elif isinstance(x, (list, tuple)):
            items = x
        else:
            continue
        if d <= MAX_NESTING:
            todo.extend((y, d + 1) for y in items)
    return None


def _depth(v: Any) -> int:
    """How many levels of lists, tuples and dicts ``v`` nests (0 for a scalar), without recursion."""
    deepest, todo = 0, [(v, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, Mapping):
            items: Any = x.values()
        elif isinstance(x, (list, tuple)):
            items = x
        else:
            continue
        deepest = max(deepest, d)
        if d <= MAX_NESTING:
            todo.extend((y, d + 1) for y in items)
    return deepest
