"""Writing PyTorch DCP's on-disk format directly (``write_dcp``), in bounded memory: each tensor is cut into row
slabs of at most 64 MiB, each slab one DCP chunk (as if saved by several ranks), read from the source while the
previous slab is written, and written as a ``torch.save`` archive filled in place (``formats.torch_file``: O_DIRECT,
valid CRCs); ``.metadata`` last, via a temporary name. DCP's loader, ``dcp_to_torch_save`` and ``formats.dcp`` all
read the result.
"""

from __future__ import annotations

import os
import pickle
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from liferaft.errors import StateMismatchError


@dataclass(frozen=True)
class DcpItem:
    """What ``write_dcp`` writes for one key: a tensor (``dtype``, ``shape`` and ``slabs``, an iterator of
    ``(offsets, tensor)`` covering it) or a value (``value``), and the nesting path DCP records for it."""

    key: str
    path: tuple[Any, ...]
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    slabs: Callable[[], Iterator[tuple[tuple[int, ...], torch.Tensor]]] | None = None
    value: Any = None


BIG = 1 << 20      # slabs from this size on are written as a skeleton plus O_DIRECT fill (tools.torch_file)


def _with_crc(slabs: Iterator[tuple[tuple[int, ...], torch.Tensor]]) -> Iterator[Any]:
    for offsets, t in slabs:
        big = t.numel() * t.element_size() >= BIG
        yield offsets, t, zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if big else None


def write_dcp(dst: str | os.PathLike[str], items: Sequence[DcpItem], progress: Callable[[int], None] | None = None,
              prefetch: Callable[[Iterator[Any]], Iterator[Any]] = iter) -> int:
    """Write ``items`` as a DCP checkpoint in folder ``dst`` (which must hold no DCP checkpoint yet): one data
    file ``__0_0.distcp``, then ``.metadata`` via a temporary name, both fsynced. Returns bytes written.
    ``prefetch`` wraps each tensor's slab iterator (to read the next slab, and compute its CRC, while this one is
    written). A slab of 1 MiB or more is written as ``torch.save``'s archive with a hole for the data, then the
    data into the hole (O_DIRECT) and its CRC into the archive; smaller ones with ``torch.save`` itself."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from liferaft.formats.torch_file import RecordFiller, placeholder, record_offsets, set_crcs, skeleton
    from liferaft.storage import files, fsync_dir

    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    if os.path.exists(os.path.join(dst, ".metadata")):
        raise StateMismatchError(f"{dst}: already holds a DCP checkpoint; choose an empty folder")
    name = "__0_0.distcp"
    path = os.path.join(dst, name)
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    fd, at_dir = files.create_exclusive(dst, name)          # never through a link planted at that name
    os.close(at_dir)
    with os.fdopen(fd, "wb") as f:
        filler = RecordFiller(path)
        try:
            for item in items:
                if item.slabs is None:
                    at = f.tell()
                    torch.save(item.value, f)
                    sd_meta[item.key] = BytesStorageMetadata()
                    storage[MetadataIndex(item.key)] = _StorageInfo(name, at, f.tell() - at)
                    continue
                chunks = []
                for i, (offsets, t, crc) in enumerate(prefetch(_with_crc(item.slabs()))):
                    at = f.tell()
                    if crc is None:
                        torch.save(t.clone(), f)            # (a clone: its storage holds only these bytes)
                        f.flush()
                    else:
                        length = skeleton(f, placeholder(tuple(t.shape), t.dtype))
                        rec = at + record_offsets(path, at, length).untyped_storage()._checkpoint_offset
                        filler.fill(rec, [t])
                        set_crcs(path, at, length, {rec: (crc, t.numel() * t.element_size())})
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(t.shape)))
                    storage[MetadataIndex(item.key, torch.Size(offsets), i)] = _StorageInfo(name, at, f.tell() - at)
                    if progress is not None:
                        progress(t.numel() * t.element_size())
                sd_meta[item.key] = TensorStorageMetadata(properties=TensorProperties(dtype=item.dtype),
                                                          size=torch.Size(item.shape), chunks=chunks)
            filler.close()
        except BaseException:
            filler.abort()
            f.close()
            os.unlink(path)                                     # (no .metadata was written: not a checkpoint)
            raise
        f.flush()
        os.fsync(f.fileno())
        total = f.tell()
    meta = Metadata(state_dict_metadata=sd_meta, planner_data={i.key: i.path for i in items},
                    storage_data=storage, storage_meta=StorageMeta(checkpoint_id=dst, save_id=str(uuid.uuid4())),
                    version="1.0.0")
    tmp = f".metadata.tmp-{uuid.uuid4().hex[:12]}"
    fd, at_dir = files.create_exclusive(dst, tmp, replace=False)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        # (a link there: replaced itself; a folder: FileAccessError naming it, tmp removed)
        files.put_in_place(tmp, ".metadata", dir_fd=at_dir, shown=os.path.join(dst, ".metadata"))
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=at_dir)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(at_dir)
    fsync_dir(dst)
    return total
