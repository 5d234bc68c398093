"""Opening a checkpoint in any format as a :class:`formats.base.Reader`: the one entry every reading path takes
(load, read, inspect, verify, diff, convert, describe, the CLI)."""

from __future__ import annotations

import os

from liferaft.codecs.registry import names as codec_names
from liferaft.core.chunks.shm import SHARED_READ_SIZE
from liferaft.core.commit import check_references, decode_verified, open_checkpoint, read_verified
from liferaft.core.native import NativeReader
from liferaft.core.process import in_call
from liferaft.core.tabled import TableSource
from liferaft.dist import Coordinator
from liferaft.errors import CheckpointNotFoundError, StateMismatchError
from liferaft.format.manifest import Manifest
from liferaft.formats.base import Reader
from liferaft.formats.detect import Format, detect, sniff
from liferaft.options import LoadOptions, check_options, check_path
from liferaft.storage import Storage, resolve
from liferaft.storage.base import read_size_of
from liferaft.storage.refs import with_references

PathLike = str | os.PathLike[str]


def format_of(path: PathLike | Storage) -> Format:
    """What ``path`` holds (``formats.detect.detect``); a storage backend or a URL is always liferaft's."""
    check_path(path, "format_of(path=...)")
    if isinstance(path, Storage):
        return "liferaft"
    return detect(path)


def _seen(path: PathLike | Storage) -> Format | None:
    """What this process sees at ``path``: its format, or None when a local path does not exist. A storage backend
    or a URL is liferaft's; an existing folder with nothing recognizable too (liferaft's reader then says what is
    wrong: an unfinished save, no checkpoint)."""
    if isinstance(path, Storage) or "://" in os.fspath(path):
        return "liferaft"
    if not os.path.lexists(os.fspath(path)):
        return None
    return sniff(path) or "liferaft"


def open_reader(path: PathLike | Storage, options: LoadOptions | None = None, *,
                coord: Coordinator | None = None, lazy: bool = False) -> Reader:
    """The checkpoint at ``path`` opened for reading, whatever its format (liferaft's verified; DCP, safetensors
    and ``torch.save`` files memory-mapped, nothing run from them). With ``coord`` it is collective: the ranks first
    agree on what the path holds (ranks that see different things — a node-local path, a shared file system not
    yet in sync — all raise at once, naming what each saw); a liferaft manifest is then read by rank 0, checked
    against its commit marker and sent to the others, and every rank decodes it (``_open_on_ranks``); foreign
    files are opened by every rank (they are memory-mapped where each rank reads); any rank's failure raises on
    every rank. ``lazy`` (one process): a version 4 checkpoint's chunk tables are read as its reads need them
    (``read`` of a few keys reads only their tables) or streamed (``verify``), not all read up front; the reader's
    ``tensors`` then list no boxes for the sharded tensors (``chunks(key)`` reads them)."""
    check_path(path)
    opts = check_options(options, LoadOptions, "open")
    where = path.url if isinstance(path, Storage) else os.fspath(path)
    seen = [_seen(path)] if coord is None else coord.run(lambda: _seen(path), "load (format)")
    if len(set(seen)) > 1:
        views = ", ".join(f"rank {r}: {s or 'nothing'}" for r, s in enumerate(seen))
        raise StateMismatchError(f"{where}: the ranks do not see the same checkpoint there ({views}); load from a "
                                 "path every rank sees alike (shared storage, or the same files on every node)")
    fmt = seen[0]
    if fmt is None:
        raise CheckpointNotFoundError(f"{where}: no checkpoint there (the path does not exist)")
    if fmt == "liferaft":
        storage = with_references(path if isinstance(path, Storage) else resolve(path))
        if coord is None and not lazy:
            return NativeReader(storage, open_checkpoint(storage, reuse=True), opts)
        if coord is None:
            index = open_checkpoint(storage, tables=False)
            return NativeReader(storage, index, opts,
                                tables=TableSource(storage, index, codec_names()) if index.tabled else None)
        manifest, size = _open_on_ranks(storage, coord, opts.max_read_bytes is None)
        lazy = TableSource(storage, manifest, codec_names()) if manifest.tabled else None
        return NativeReader(storage, manifest, opts, tables=lazy, read_size=size)
    if coord is None:
        return _open_foreign(os.fspath(path), fmt)
    opened: list[Reader] = []
    coord.run(lambda: opened.append(_open_foreign(os.fspath(path), fmt)), "load (open)")
    return opened[0]


def _open_on_ranks(storage: Storage, coord: Coordinator, sized: bool) -> tuple[Manifest, int | None]:
    """``open_checkpoint`` collectively: rank 0 reads the commit marker and the manifest and checks the manifest's
    bytes against the marker (``read_verified``), every rank gets those bytes and decodes them itself, at the
    same time (``decode_verified``: the same bytes and codecs, the same manifest; a pickled decoded manifest took
    longer to pickle and unpickle than to decode; nothing kept for reuse: a job's ranks do not hold a manifest
    after the load), and rank 0 checks the references (siblings' manifests, read from storage). Any rank's
    failure raises on every rank. Also the read size the ranks agree on (``sized``: this rank takes its storage's
    ``read_size``): the smallest ``read_size`` of the ranks that take it (None where no rank does), so that every
    rank plans its reads and the host's sharing alike (ranks reading one checkpoint from a disk and from a copy
    in RAM answer 8 and 4 MiB); on several ranks from local storage at most ``shm.SHARED_READ_SIZE`` (the size
    of the slots of the host's shared reads)."""
    data, name = coord.run_on_zero(lambda: read_verified(storage), "load (open)")
    opened: list[Manifest] = []

    def decode() -> int:
        manifest = decode_verified(storage, data, name, tables=False)     # (chunk tables: read as needed)
        if coord.rank == 0:
            check_references(storage, manifest)
        opened.append(manifest)
        if not sized:
            return 0
        size = read_size_of(storage)
        return min(size, SHARED_READ_SIZE) if coord.world > 1 and not getattr(storage, "remote", False) else size
    sizes = [n for n in coord.run(decode, "load (open)") if n]
    return opened[0], min(sizes) if sizes else None


def _open_foreign(path: str, fmt: Format) -> Reader:
    if fmt == "dcp":
        from liferaft.formats.dcp import DcpReader

        return DcpReader(path)
    if fmt == "safetensors":
        from liferaft.formats.safetensors import SafetensorsReader

        return SafetensorsReader(path)
    from liferaft.formats.torch_file import TorchFileReader

    return TorchFileReader(path)


__all__ = ["format_of", "in_call", "open_reader"]
