"""Opening a checkpoint in any format as a :class:`formats.base.Reader`: the one entry every reading path takes
(load, read, inspect, verify, diff, convert, describe, the CLI)."""

from __future__ import annotations

import os

from liferaft.core.commit import open_checkpoint
from liferaft.core.native import NativeReader
from liferaft.dist import Coordinator
from liferaft.formats.base import Reader
from liferaft.formats.detect import Format, detect, sniff
from liferaft.options import LoadOptions
from liferaft.storage import Storage, resolve
from liferaft.storage.refs import with_references

PathLike = str | os.PathLike[str]


def format_of(path: PathLike | Storage) -> Format:
    """What ``path`` holds (``formats.detect.detect``); a storage backend or a URL is always liferaft's."""
    if isinstance(path, Storage):
        return "liferaft"
    return detect(path)


def open_reader(path: PathLike | Storage, options: LoadOptions | None = None, *,
                coord: Coordinator | None = None) -> Reader:
    """The checkpoint at ``path`` opened for reading, whatever its format (liferaft's verified; DCP, safetensors
    and ``torch.save`` files memory-mapped, nothing run from them). With ``coord`` it is collective: a liferaft
    manifest is read and verified by rank 0 and sent to the others; foreign files are opened by every rank (they
    are memory-mapped where each rank reads); any rank's failure raises on every rank."""
    opts = options or LoadOptions()
    fmt: Format = "liferaft" if isinstance(path, Storage) or sniff(path) in (None, "liferaft") else detect(path)
    if fmt == "liferaft":
        storage = with_references(path if isinstance(path, Storage) else resolve(path))
        if coord is None:
            return NativeReader(storage, open_checkpoint(storage), opts)
        return NativeReader(storage, coord.run_on_zero(lambda: open_checkpoint(storage), "load (open)"), opts)
    if coord is None:
        return _open_foreign(os.fspath(path), fmt)
    opened: list[Reader] = []
    coord.run(lambda: opened.append(_open_foreign(os.fspath(path), fmt)), "load (open)")
    return opened[0]


def _open_foreign(path: str, fmt: Format) -> Reader:
    if fmt == "dcp":
        from liferaft.formats.dcp import DcpReader

        return DcpReader(path)
    if fmt == "safetensors":
        from liferaft.formats.safetensors import SafetensorsReader

        return SafetensorsReader(path)
    from liferaft.formats.torch_file import TorchFileReader

    return TorchFileReader(path)


__all__ = ["format_of", "open_reader"]
