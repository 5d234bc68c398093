"""Write this rank's share of a save plan to its data file from staged pieces: hash, reuse, encode, write.

Per chunk, in plan order, the writer
- hashes the raw bytes in blocks (CRC-32C) and whole (the 64-bit chunk digest) as they arrive from staging (no
  extra read of old data);
- if the chunk's box was stored with the same block hashes and digest by the base checkpoint of an incremental
  save, writes nothing and records a reference to the stored bytes (``ChunkPolicy.reuse``; ``_unchanged``: never
  on fewer than 64 bits);
- else encodes it (lossless byte planes + zstd where that pays, or an opt-in lossy codec) on the codec worker
  threads while it goes on with the next chunks (``core.chunks.encoding``: encoding overlaps the writes), or
  writes the raw pieces straight from the pool (O_DIRECT for the whole pages of large chunks: their pieces lie in
  the pool as their ranges do in the file, ``save_plan.place``), or, in a synchronous save through a pool
  of 4 KiB pages, a large chunk of a contiguous host tensor straight from the tensor's memory
  (``write_streamed``'s ``sources_stable``).
Chunks are laid out one after the other in the order written, so the file holds only what was written.
Deciding reuse or encoding needs the whole chunk: a chunk is held in the pool until complete, unless the pool
is too small for it, or the stager waits for room that only this chunk's release would make: then it is written
raw as it streams (as every chunk is when nothing is to be decided).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from liferaft.codecs import frames, registry
from liferaft.codecs.base import EncodedChunk
from liferaft.codecs.checksum import CHECKSUM_BITS, BlockHasher, block_hashes, choose_block_size
from liferaft.core.chunks.behind import Write, WriteBehind
from liferaft.core.chunks.encoding import EncodeQueue, InFlight
from liferaft.errors import StorageError
from liferaft.format.manifest import CHECKSUM_ALGO, ChunkRecord
from liferaft.planning.geometry import Box
from liferaft.planning.save_plan import PAGE, PAGE_ALIGN_MIN, WriteItem, page_phase, place
from liferaft.staging.pool import BufferPool
from liferaft.staging.stager import Piece, PieceQueue, StageFailed, stage, streamed_piece_limit
from liferaft.storage.base import FileWriter, Storage

ReuseKey = tuple[str, tuple[int, ...], tuple[int, ...]]       # (tensor key, offsets, sizes)


@dataclass
class ChunkPolicy:
    """How the writer stores each chunk of one save (decided before it starts, the same on every rank).

    compress: try the lossless codec (``registry.LOSSLESS``) on every chunk (kept per chunk only where its first
        block shrinks below ``frames.PAYS_RATIO``).
    lossy: tensor key → lossy codec name (``registry.QUANTIZE``) for keys the caller opted in.
    reuse: (key, offsets, sizes) → the base checkpoint's record of that box (its files already relative to the
        new checkpoint) and the sizes of the files it needs; a chunk with the same block hashes is referenced,
        not written.
    delta: the same for the boxes to store as an XOR delta against the base's bytes (never a delta record itself);
        ``reader`` reads those bytes.
    codecs: where codec names are looked up (the process's registry; a test may give its own).
    foreground: training waits for this save (a sync save): encoding may use a codec thread per core, where a
        background save keeps to half the cores (``codecs.frames.executor``). Changes no stored byte.
    """

    dtypes: Mapping[str, str]
    block_size: int | None = None
    alignment: int = 64
    compress: bool = False
    lossy: Mapping[str, str] = field(default_factory=dict)
    reuse: Mapping[ReuseKey, tuple[ChunkRecord, dict[str, int]]] = field(default_factory=dict)
    delta: Mapping[ReuseKey, tuple[ChunkRecord, dict[str, int]]] = field(default_factory=dict)
    reader: Storage | None = None
    selective: Mapping[str, float] = field(default_factory=dict)     # key -> relative change threshold
    codecs: registry.CodecRegistry = field(default_factory=lambda: registry.CODECS)
    foreground: bool = False

    def decides(self, item: WriteItem) -> bool:
        """Whether ``item`` needs its whole bytes before it can be written."""
        box = (item.key, item.offsets, item.sizes)
        return self.compress or item.key in self.lossy or box in self.reuse or box in self.delta \
            or item.key in self.selective


@dataclass
class StoredChunk:
    """Where and how one write item was stored (``file`` may be a sibling checkpoint's, for a reference)."""

    file: str
    byte_offset: int
    block_size: int
    hashes: tuple[str, ...]
    codec: str | None = None
    frames: tuple[int, ...] | None = None
    delta: ChunkRecord | None = None
    ref_files: dict[str, int] | None = None         # sizes of the files this chunk needs besides the rank's own
    error: tuple[float, float, int] | None = None   # lossy: (max abs error, sum of abs errors, values)
    stale: float | None = None      # selective: not saved; the base's older bytes, this relative change away
    origin: str | None = None       # copied from this sibling checkpoint (``rehome``) rather than referenced
    checksum: str = CHECKSUM_ALGO   # the algorithm of ``hashes`` (a reference keeps its base chunk's)
    digest: str | None = None       # ``ChunkRecord.digest``: of the raw bytes (None: a lossy chunk)


@dataclass
class WriteOutcome:
    chunks: list[StoredChunk]
    file_size: int                  # of this rank's data file (0: none written)
    bytes_written: int              # stored bytes written to it
    stage_s: float
    write_s: float
    encode_s: float = 0.0
    bytes_reused: int = 0           # raw bytes of chunks referenced instead of written
    bytes_encoded: int = 0          # raw bytes of the chunks stored encoded


def write_streamed(storage: Storage, items: Sequence[WriteItem], sources: Mapping[tuple[str, Box], torch.Tensor],
                   pool: BufferPool, policy: ChunkPolicy, sources_stable: bool = False) -> WriteOutcome:
    """Write ``items`` (all in one file) from ``sources[(key, box)]`` through ``pool``; durable on return.

    A staging thread copies pieces of at most a quarter of the pool into it while this thread writes the
    previous ones, so memory stays within the pool however large the state. ``sources_stable`` (a synchronous
    save: nothing changes the sources until it returns), unless the pool is huge pages (``BufferPool.huge``): a
    large chunk written raw from a contiguous host tensor that lies where its file range does within a page
    (``save_plan.place``, ``page_phase``), is hashed and written straight from the tensor's memory: its whole
    pages go to storage with O_DIRECT, uncopied. Through a pool of huge pages every chunk is copied into it
    instead (one ``memmove`` per piece on the stager thread, ``stage(one_thread=True)``): a request from 2 MiB pages reaches
    the device in 2 MiB pieces, from a tensor's 4 KiB pages in 4 KiB ones, and the writer joins the pieces of
    consecutive chunks into one request (``behind.Write``). Measured here, 0.54 GB: a process's second save
    0.345-0.383 s copied against 0.441-0.495 in place (fresh processes); 8 x 64 MiB in one process 0.22 s
    against 0.36-0.38. A process's first save pays the ring's first touch (64 MiB, resident from then on).
    On error the partial file is removed and the error re-raised.
    """
    pieces = PieceQueue()
    limit = streamed_piece_limit(pool.capacity)
    copy_s = [0.0]

    def in_place(idx: int, src: torch.Tensor) -> bool:
        """A chunk written raw from a contiguous host tensor whose address keeps the file's alignment: no copy."""
        return not pool.huge and not policy.decides(items[idx]) and src.device.type == "cpu" and \
            src.is_contiguous() and items[idx].length >= PAGE_ALIGN_MIN and \
            src.data_ptr() % PAGE == page_phase(policy.alignment)

    def run_stage() -> None:
        with contextlib.suppress(BaseException):   # queued as StageFailed for the writer, which raises it
            copy_s[0] = stage(items, sources, pool, pieces, limit, in_place=in_place if sources_stable else None,
                              phase=page_phase(policy.alignment), one_thread=True)

    stager = threading.Thread(target=run_stage, name="liferaft-stager", daemon=True)
    stager.start()
    try:
        out = write_staged(storage, items, pieces, pool, policy)
    finally:
        stager.join()
    out.stage_s = copy_s[0]
    return out


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class _File:
    """This rank's data file, created at the first write; chunks are appended at aligned positions.

    Positions are reserved (``start``, ``reserve_frames``) by the writer thread; every write (``pwrite``,
    ``put_frames``: its page-aligned scratch buffer is that thread's) runs on the I/O thread, one at a time, so a
    storage's writer is never used by two threads at once."""

    def __init__(self, storage: Storage, name: str | None, alignment: int) -> None:
        self.storage, self.name, self.alignment = storage, name, alignment
        self.w: FileWriter | None = None
        self.end = 0
        self._scratch: torch.Tensor | None = None

    def reserve_frames(self, frames: Sequence[bytes]) -> tuple[int, int]:
        """Reserve room for encoded frames written back to back; return (position, length). A large run starts on
        a page (``put_frames`` writes it from a page-aligned copy, so that it goes to storage with O_DIRECT:
        through the page cache, a write on these VMs runs at a fraction of the disk's speed)."""
        n = sum(len(x) for x in frames)
        return self.start(n), n

    def put_frames(self, frames: Sequence[bytes], pos: int, n: int) -> None:
        """Write ``frames`` (``n`` bytes in all) back to back at ``pos`` (from ``reserve_frames``)."""
        if n < PAGE_ALIGN_MIN:
            self.pwrite(b"".join(frames), pos)
            return
        phase = pos % PAGE                          # (the copy lies as the file range does within a page)
        if self._scratch is None or self._scratch.numel() < n + phase:
            from liferaft.staging.pool import page_aligned_empty

            self._scratch = None
            self._scratch = page_aligned_empty(max(n, 1 << 20) + PAGE)
        buf = memoryview(self._scratch.numpy()).cast("B")[phase:]
        at = 0
        for x in frames:
            buf[at:at + len(x)] = x
            at += len(x)
        self.pwrite(buf[:n], pos)

    def start(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the next position ``save_plan.place`` gives (a large chunk ``PAGE_PHASE`` bytes into
        a page: where a large host tensor lies in memory, and the pool's large pieces); return it."""
        pos = place(self.end, nbytes, self.alignment)
        self.end = pos + nbytes
        return pos

    def pwrite(self, data: memoryview | bytes, offset: int) -> None:
        if self.w is None:
            assert self.name is not None
            self.w = self.storage.open_writer(self.name)
        self.w.pwrite(data, offset)


def write_staged(storage: Storage, items: Sequence[WriteItem], pieces: PieceQueue, pool: BufferPool,
                 policy: ChunkPolicy) -> WriteOutcome:
    """Write staged pieces (see ``staging.stager``) as they arrive; durable on return.

    Each piece's pool region is released once written (or once its chunk is decided; an encoded chunk's, once
    its frames are written). Raw pieces and encoded frames are written by the I/O thread (``behind.WriteBehind``)
    while this thread hashes the next pieces and the codec threads encode the next chunks; every pool region is
    released by that thread, in submission order, so regions are given back in the order they were taken (as
    ``staging.BufferPool`` requires) even when a chunk held whole is decided (a reference) while earlier chunks'
    frames are still being written. On error (an encoder's or a write's included) the chunks still encoding and
    the write running are waited for, the partial file is removed, the pool is reset (waking a stager that waits
    for room) and the error re-raised.
    """
    out = WriteOutcome(chunks=[], file_size=0, bytes_written=0, stage_s=0.0, write_s=0.0)
    f = _File(storage, items[0].file if items else None, policy.alignment)
    held: list[Piece] = []          # pieces of the chunk being assembled (decided chunks only)
    hasher: BlockHasher | None = None
    base = 0                         # file position of the chunk streamed raw
    slots: list[StoredChunk | None] = []

    behind = WriteBehind()

    def finish(item: InFlight, enc: EncodedChunk | None, took: float) -> None:
        slots[item.slot] = _write_encoded(f, behind, item.context, item.held, enc, took, out, pool)

    encoding = EncodeQueue(finish, policy.foreground)
    try:
        for idx, w in enumerate(items):
            hasher = BlockHasher(choose_block_size(w.length, policy.block_size), CHECKSUM_ALGO, whole=True)
            decide = policy.decides(w) and w.length <= pool.capacity     # (else it could never be held whole)
            got = 0
            base = f.start(w.length) if not decide else 0
            while got < w.length:
                piece = _next(pieces, pool, waiting_ok=not (decide and held), encoding=encoding, behind=behind)
                if piece is None:                       # the stager is out of room: stream this chunk raw
                    decide = False
                    base = f.start(w.length)
                    encoding.drain()        # (pool regions are released in the order they were taken)
                    for p in held:
                        _write_behind(behind, f, p, base, out, pool)
                    held.clear()
                    continue
                assert piece.item == idx, "pieces out of order"
                mv = memoryview(piece.data.numpy()).cast("B")
                hasher.update(mv)
                got += len(mv)
                del mv
                if decide:
                    held.append(piece)
                else:
                    encoding.drain()
                    _write_behind(behind, f, piece, base, out, pool)
            hashes = tuple(hasher.finish())
            whole = hasher.digest()
            slots.append(None)
            if decide:
                stored = _decided(f, behind, w, held, (hashes, whole), hasher.block_size, policy, out, encoding,
                                  len(slots) - 1)
                if stored is not None:
                    slots[-1] = stored
                    encoding.drain()
                    _release_behind(behind, held, pool)
                held = []                   # (an encoding chunk keeps its list until its frames are written)
            else:
                slots[-1] = StoredChunk(file=w.file, byte_offset=base, block_size=hasher.block_size, hashes=hashes,
                                        digest=whole)
            encoding.collect()
        encoding.drain()
        behind.flush()
        out.chunks = [sc for sc in slots if sc is not None]
        assert len(out.chunks) == len(items), "a chunk was not stored"
        end = pieces.get()
        if isinstance(end, StageFailed):
            raise end.error
        t0 = time.perf_counter()
        if f.w is not None:
            f.w.close()
            out.file_size = f.end
            _still_there(storage, f.name, f.end)
        out.write_s += time.perf_counter() - t0
    except BaseException as e:
        encoding.cancel()
        behind.close()
        if f.w is not None:
            f.w.abort()
        pool.reset()
        if isinstance(e, OSError):
            raise StorageError(f"{storage.url}: writing data file {f.name!r} failed: {e}") from e
        raise
    finally:
        behind.close()
        out.write_s += behind.seconds
    return out


def _still_there(storage: Storage, name: str | None, size: int) -> None:
    """On local storage, after this rank's data file is durable: StorageError unless it is still there, at least
    ``size`` bytes long. A folder removed or truncated by another program while the save ran (a framework's
    clean-up of old checkpoints) then fails the save, on every rank, instead of being committed without its data.
    (An object store is not asked: one request more per rank.)"""
    if name is None or storage.remote:
        return
    try:
        got = storage.size(name)
    except FileNotFoundError:
        got = -1
    if got < size:
        raise StorageError(f"{storage.url}: data file {name!r} is {'gone' if got < 0 else f'{got} bytes'} right "
                           f"after it was written ({size} bytes): something removed or changed the checkpoint's "
                           "folder while the save ran; the save is not committed")


def _next(pieces: PieceQueue, pool: BufferPool, waiting_ok: bool, encoding: EncodeQueue,
          behind: WriteBehind) -> Piece | None:
    """The next staged piece; None when the stager waits for room that only this writer can free (while a
    chunk is being held: ``waiting_ok`` False, and no chunk is encoding and no write is pending whose
    completion would free some). Meanwhile the chunks whose encoding ended are handed to the I/O thread, and a
    write behind that failed raises (its pool regions are never given back: the stager would wait for them
    forever)."""
    while True:
        encoding.collect()
        behind.check()          # (the writes kept back to be joined: the I/O thread takes them once idle)
        try:
            piece = pieces.get(timeout=None if waiting_ok and not encoding and not behind else 0.005)
        except queue.Empty:
            if pool.waiting:
                if encoding:
                    encoding.complete_oldest()         # its write, once done, frees its pool regions
                elif not waiting_ok and not behind:
                    return None
            continue
        if piece is None:
            raise RuntimeError("staging ended before every chunk was staged")
        if isinstance(piece, StageFailed):
            raise piece.error
        if piece.event is not None:
            piece.event.synchronize()
        return piece


def _write_behind(behind: WriteBehind, f: _File, piece: Piece, base: int, out: WriteOutcome,
                  pool: BufferPool) -> None:
    """Hand ``piece`` (hashed) to the I/O thread, which writes it at ``base`` + its offset and releases it."""
    out.bytes_written += piece.data.numel()
    region = piece.region
    behind.submit(Write(f.pwrite, piece.data, base + piece.offset,
                        (lambda: pool.release(region)) if region >= 0 else None))


def _release_behind(behind: WriteBehind, held: Sequence[Piece], pool: BufferPool) -> None:
    """Release ``held``'s pool regions on the I/O thread, after the writes submitted before (in order)."""
    regions = [p.region for p in held]

    def job() -> None:
        for r in regions:
            if r >= 0:
                pool.release(r)

    behind.submit(job)


def _blocks(held: Sequence[Piece], block_size: int) -> list[memoryview]:
    """The chunk's raw hash blocks as views into the held pieces (joined where a block spans two pieces)."""
    views = [memoryview(p.data.numpy()).cast("B") for p in held]
    if len(views) == 1:
        v = views[0]
        return [v[i:i + block_size] for i in range(0, len(v), block_size)]
    whole = memoryview(b"".join(views))
    return [whole[i:i + block_size] for i in range(0, len(whole), block_size)]


def _decided(f: _File, behind: WriteBehind, w: WriteItem, held: Sequence[Piece],
             sums: tuple[tuple[str, ...], str | None], block_size: int, policy: ChunkPolicy, out: WriteOutcome,
             encoding: EncodeQueue, slot: int) -> StoredChunk | None:
    """Store a whole held chunk (``sums``: its block hashes and chunk digest): as a reference, as a delta or raw
    (their writes handed to the I/O thread; the caller then releases ``held`` there), or (None) submitted to
    ``encoding``, whose ``finish`` has its frames written and ``held`` released on the I/O thread."""
    hashes, whole = sums
    base = policy.reuse.get((w.key, w.offsets, w.sizes))
    if base is not None and _unchanged(base[0], w, held, hashes, whole, block_size):
        rec, sizes = base
        out.bytes_reused += w.length
        return StoredChunk(file=rec.file, byte_offset=rec.byte_offset, block_size=rec.block_size, hashes=rec.hashes,
                           codec=rec.codec, frames=rec.frames, delta=rec.delta, ref_files=sizes,
                           checksum=rec.checksum, digest=rec.digest)
    dtype = policy.dtypes[w.key]
    if base is not None and w.key in policy.selective and policy.reader is not None:
        change = _change(held, base[0], dtype, w.key, policy.reader)
        if change is not None and change < policy.selective[w.key]:
            rec, sizes = base
            out.bytes_reused += w.length
            return StoredChunk(file=rec.file, byte_offset=rec.byte_offset, block_size=rec.block_size,
                               hashes=rec.hashes, codec=rec.codec, frames=rec.frames, delta=rec.delta,
                               ref_files=sizes, stale=change, checksum=rec.checksum, digest=rec.digest)
    delta = policy.delta.get((w.key, w.offsets, w.sizes))
    if delta is not None and w.length and policy.reader is not None:
        stored = _delta(f, behind, w, held, sums, block_size, delta, policy, out)
        if stored is not None:
            return stored
    codec = policy.lossy.get(w.key) or (registry.LOSSLESS if policy.compress else None)
    if codec is not None and w.length:
        impl = policy.codecs.get(codec, f"key {w.key!r}")
        encoding.submit(slot, impl, _blocks(held, block_size), dtype, frames.PAYS_RATIO if impl.lossless else None,
                        held, (w, sums, block_size, codec))
        return None
    return _write_held_raw(f, behind, w, held, sums, block_size, out)


def _write_held_raw(f: _File, behind: WriteBehind, w: WriteItem, held: Sequence[Piece],
                    sums: tuple[tuple[str, ...], str | None], block_size: int, out: WriteOutcome) -> StoredChunk:
    """Place a whole held chunk raw and hand its write to the I/O thread (the caller releases ``held`` after it,
    with ``_release_behind``)."""
    pos = f.start(w.length)
    for p in held:
        behind.submit(Write(f.pwrite, p.data, pos + p.offset))
    out.bytes_written += w.length
    return StoredChunk(file=w.file, byte_offset=pos, block_size=block_size, hashes=sums[0], digest=sums[1])


def _write_encoded(f: _File, behind: WriteBehind,
                   context: tuple[WriteItem, tuple[tuple[str, ...], str | None], int, str], held: Sequence[Piece],
                   enc: EncodedChunk | None, took: float, out: WriteOutcome, pool: BufferPool) -> StoredChunk:
    """Place a chunk whose encoding ended (``enc`` None: the codec declined it, stored raw) and hand its write, then
    the release of ``held``, to the I/O thread. A lossy chunk (its ``hashes`` are those of the decoded values, not
    of the bytes hashed while staging) gets no digest."""
    w, (hashes, whole), block_size, codec = context
    out.encode_s += took
    if enc is None:
        stored = _write_held_raw(f, behind, w, held, (hashes, whole), block_size, out)
        _release_behind(behind, held, pool)
        return stored
    pos, n = f.reserve_frames(enc.frames)
    frames_out = enc.frames
    behind.submit(lambda: f.put_frames(frames_out, pos, n), holds=n)
    _release_behind(behind, held, pool)
    out.bytes_written += n
    out.bytes_encoded += w.length
    return StoredChunk(file=w.file, byte_offset=pos, block_size=block_size, hashes=enc.hashes or hashes,
                       codec=codec, frames=tuple(len(x) for x in enc.frames), error=enc.error,
                       digest=None if enc.hashes or enc.error is not None else whole)


def _unchanged(rec: ChunkRecord, w: WriteItem, held: Sequence[Piece], hashes: tuple[str, ...], whole: str | None,
               block_size: int) -> bool:
    """Whether the held chunk (block ``hashes``, chunk digest ``whole``) holds the bytes of the base's ``rec``,
    decided on at least 64 bits (docs/FORMAT.md §4.2): every block hash equal by ``rec``'s algorithm AND, when
    that algorithm has fewer than 64 bits (``crc32c``: a chunk changed within one block would pass with
    probability 2**-32), equal chunk digests. A base chunk with 32-bit block hashes and no digest (written before
    digests) is never taken as unchanged: the chunk is written again."""
    if rec.block_size != block_size or rec.length != w.length:
        return False
    if rec.digest is not None:
        if whole is None or rec.digest != whole:
            return False
    elif CHECKSUM_BITS.get(rec.checksum, 0) < 64:
        return False
    return rec.hashes == _hashes_as(rec.checksum, held, hashes, block_size)


def _hashes_as(algo: str, held: Sequence[Piece], hashes: tuple[str, ...], block_size: int) -> tuple[str, ...]:
    """The held chunk's block hashes by ``algo``: ``hashes`` (computed while staging, by ``CHECKSUM_ALGO``), or
    hashed again when a base chunk written before ``crc32c`` names another, so that an unchanged chunk is still
    recognised across the change of algorithm (docs/FORMAT.md §3.1)."""
    if algo == CHECKSUM_ALGO:
        return hashes
    views = [memoryview(p.data.numpy()).cast("B") for p in held]
    whole = views[0] if len(views) == 1 else memoryview(b"".join(views))
    return tuple(block_hashes(whole, block_size, algo))


def _change(held: Sequence[Piece], base: ChunkRecord, dtype: str, key: str, reader: Storage) -> float | None:
    """‖x − x_base‖ / ‖x_base‖ of this chunk against the base's stored values (None: not comparable)."""
    from liferaft.core.chunks.blocks import read_blocks
    from liferaft.errors import LiferaftError
    from liferaft.state.dtypes import torch_dtype

    try:
        old = read_blocks(reader, base, 0, len(base.hashes), dtype, key)
    except (LiferaftError, OSError):
        return None
    tdt = torch_dtype(dtype)
    cur = torch.cat([p.data for p in held]).view(tdt).double() if len(held) > 1 else held[0].data.view(tdt).double()
    ref = torch.frombuffer(old, dtype=tdt).double()
    if cur.numel() != ref.numel() or not bool(torch.isfinite(cur).all()):
        return None
    norm = float(ref.norm())
    diff = float((cur - ref).norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def _delta(f: _File, behind: WriteBehind, w: WriteItem, held: Sequence[Piece],
           sums: tuple[tuple[str, ...], str | None], block_size: int, delta: tuple[ChunkRecord, dict[str, int]],
           policy: ChunkPolicy, out: WriteOutcome) -> StoredChunk | None:
    """Store the chunk as the XOR of its bytes with the base's bytes of the same box, compressed, its frames
    written by the I/O thread (None: the base cannot be read and verified; the chunk is then stored as if no
    delta was asked for)."""
    from liferaft.core.chunks.blocks import read_blocks, xor_into
    from liferaft.errors import LiferaftError

    rec, sizes = delta
    t0 = time.perf_counter()
    try:
        assert policy.reader is not None
        base = read_blocks(policy.reader, rec, 0, len(rec.hashes), policy.dtypes[w.key], w.key)
    except (LiferaftError, OSError):
        return None
    cur = bytearray(b"".join(memoryview(p.data.numpy()).cast("B") for p in held))
    xor_into(memoryview(cur), base)
    view = memoryview(cur)
    enc = registry.get(registry.LOSSLESS).encode_chunk(
        [view[i:i + block_size] for i in range(0, len(view), block_size)], policy.dtypes[w.key],
        frames.executor(policy.foreground))
    assert enc is not None          # (lossless, and not asked whether it pays: always encodes)
    out.encode_s += time.perf_counter() - t0
    pos, n = f.reserve_frames(enc.frames)
    frames_out = enc.frames
    behind.submit(lambda: f.put_frames(frames_out, pos, n), holds=n)
    out.bytes_written += n
    out.bytes_encoded += w.length
    return StoredChunk(file=w.file, byte_offset=pos, block_size=block_size, hashes=sums[0], codec=registry.LOSSLESS,
                       frames=tuple(len(x) for x in enc.frames), delta=rec, ref_files=sizes, digest=sums[1])
