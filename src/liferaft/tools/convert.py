"""Move checkpoints between formats: liferaft ↔ safetensors (single file or sharded with
``model.safetensors.index.json``), ↔ ``torch.save`` files (read with ``weights_only=True``) and ↔ PyTorch DCP;
liferaft → a Hugging Face model folder that ``from_pretrained`` loads (``to_hf``: the one module's weights under its
own names, its config and tokenizer files); ``convert`` picks the direction (docs/cli/convert.md).

Every direction streams, holding a few 64 MiB slabs, never the state: exports read each tensor in row slabs
(the next slab read while this one is written) into safetensors written here directly (8-byte header length, JSON
header, raw bytes; page-aligned, O_DIRECT), into a ``torch.save`` archive whose records are filled in place
(``tools.torch_file``) or into DCP's format (``tools.dcp_format``); imports memory-map the source (safetensors and
``torch.save`` files as they are, DCP chunks where DCP's blobs keep their bytes) and save from the mapping. Keys
can be selected (keys, prefixes or globs) and renamed (regex) in every direction; the results are checked against the
``safetensors`` package, ``torch.load`` and DCP's own loader in the tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from liferaft.core.commit import check_files, open_checkpoint
from liferaft.errors import CorruptCheckpointError, InvalidStateError, OptionsError
from liferaft.formats.base import matches
from liferaft.formats.hf_folder import (  # noqa: F401 (the API of this module too)
    bring_config,
    model_subtree,
    open_regular,
    plan_config,
    recorded_files,
    st_files,
    write_config,
)
from liferaft.formats.safetensors import FROM_ST, ST_DTYPES, safetensors_state  # noqa: E402,F401
from liferaft.options import ConvertFormat, SaveOptions
from liferaft.state.dtypes import torch_dtype
from liferaft.storage import resolve
from liferaft.storage.refs import with_references

INDEX = "model.safetensors.index.json"


def _renamer(rename: Sequence[tuple[str, str]] | None):
    pats = [(re.compile(p), r) for p, r in (rename or ())]

    def apply(key: str) -> str:
        for p, r in pats:
            key = p.sub(r, key)
        return key
    return apply


def _selected(key: str, keys: Sequence[str] | None) -> bool:
    """Whether ``keys`` select ``key``: a key, a prefix (``model`` selects ``model.*``) or a glob
    (``formats.base.matches``, the one meaning of ``keys=``)."""
    return matches(key, keys)


def _refuse_per_rank(entries: Sequence[Any]) -> None:
    """An export writes each tensor under its plain name with its shape: a tensor stored per rank (its copies
    differed between the saving ranks; stored as ``[ranks, *shape]``) has no one value to write, so it is
    refused, naming it, before anything is written (docs/cli/convert.md)."""
    bad = [e for e in entries if getattr(e, "per_rank", None) is not None]
    if bad:
        e = bad[0]
        others = ", ".join(repr(b.key) for b in bad[1:4]) + (", ..." if len(bad) > 4 else "")
        more = f" (and {len(bad) - 1} more: {others})" if len(bad) > 1 else ""
        raise OptionsError(
            f"key {e.key!r}{more} was stored per rank: its copies differed between the {len(e.per_rank)} saving "
            f"ranks, so there is no one {list(e.shape[1:])} tensor to export under its name; nothing was written. "
            "Leave it out by selecting the other keys with --key GLOB (keys=...), or read each rank's copy with "
            "liferaft.read")


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote: the files or folder (``files``), how many tensors, and bytes written; for an
    ``hf`` export the module exported (its key in the checkpoint, "" for the whole) and notes for the user (where
    the config came from, or that there is none)."""

    files: tuple[str, ...]
    tensors: int
    bytes: int
    module: str | None = None
    notes: tuple[str, ...] = ()


def to_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, max_shard_bytes: int = 5 << 30,
                   dtype: str | None = None, keys: Sequence[str] | None = None,
                   rename: Sequence[tuple[str, str]] | None = None,
                   progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Export the tensors of liferaft checkpoint ``src`` — all of them, under their full keys — to the folder
    ``dst`` as safetensors: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` plus ``model.safetensors.index.json``. ``dtype`` (e.g. "bfloat16") casts floating-point
    tensors. (``to_hf`` writes a folder ``from_pretrained`` loads: one module's weights, its config.)"""
    storage = with_references(resolve(src))
    m = open_checkpoint(storage)
    rn = _renamer(rename)
    picked = [(e, rn(e.key)) for e in m.tensors if e.kind == "tensor" and _selected(e.key, keys)]
    if keys and not picked:
        raise OptionsError(f"no tensor of the checkpoint matches {list(keys)}")
    _refuse_per_rank([e for e, _ in picked])
    files, total = _write_safetensors(storage, m, picked, dst, max_shard_bytes, dtype, progress)
    return ConvertReport(files=tuple(files), tensors=len(picked), bytes=total)


def _write_safetensors(storage: Any, m: Any, pairs: list[tuple[Any, str]], dst: str | os.PathLike[str],
                       max_shard_bytes: int, dtype: str | None,
                       progress: Callable[[int], None] | None) -> tuple[list[str], int]:
    """Write the tensor entries ``pairs`` ((entry, name)) as ``model.safetensors`` or shards of at most
    ``max_shard_bytes`` with their index in ``dst``; weight files of an earlier export there are removed.
    Returns (file names, tensor bytes)."""
    cast = torch_dtype(dtype) if dtype else None
    picked = []
    for e, name in pairs:
        out_dtype = dtype if cast is not None and torch_dtype(e.dtype).is_floating_point else e.dtype
        if out_dtype not in ST_DTYPES:
            raise InvalidStateError(f"key {e.key!r}: dtype {out_dtype} has no safetensors name")
        size = int(np.prod(e.shape, dtype=np.int64)) * torch.empty(0, dtype=torch_dtype(out_dtype)).element_size()
        picked.append((e, name, out_dtype, size))
    names = [p[1] for p in picked]
    if len(set(names)) != len(names):
        raise OptionsError("the renaming maps two keys to one name")
    check_files(storage, m, {c.file for e, *_ in picked for c in e.chunks})
    shards: list[list[Any]] = [[]]
    for p in picked:
        if shards[-1] and sum(q[3] for q in shards[-1]) + p[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(p)
    os.makedirs(dst, exist_ok=True)
    files, total, weight_map = [], 0, {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(storage, os.path.join(dst, name), shard, progress)
        files.append(name)
        for e, key, _, size in shard:
            weight_map[key] = name
            total += size
    if len(shards) > 1:
        with _created(os.path.join(dst, INDEX + ".tmp")) as f:
            f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
        os.replace(os.path.join(dst, INDEX + ".tmp"), os.path.join(dst, INDEX))
        files.append(INDEX)
    for old in os.listdir(dst):                 # an earlier export's weights would be read instead, or as well
        if old not in files and (old == INDEX or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", old)):
            os.unlink(os.path.join(dst, old))
    return files, total


def _created(path: str) -> Any:
    """``path`` created anew for writing: whatever lay there (a link to elsewhere, a FIFO) removed first, never
    written through."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                             0o644), "wb")


def _write_shard(storage: Any, path: str, shard: list[Any], progress: Callable[[int], None] | None = None) -> None:
    """One safetensors file, streamed: the header padded (with spaces, as the format allows) so that the data
    starts on a 4 KiB page, then each tensor in row slabs read into ring buffers on the file's page boundaries
    and written by ``RecordFiller`` (O_DIRECT for whole pages: through the page cache a write runs at a fraction
    of the disk's speed here). Written to ``path + ".tmp"``, fsynced, renamed."""
    from liferaft.formats.torch_file import RecordFiller
    from liferaft.staging.pool import page_aligned_empty
    from liferaft.storage.posix import _fsync_dir
    from liferaft.tools._slabs import prefetched, slab_values

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e, key, out_dtype, size in shard:
        header[key] = {"dtype": ST_DTYPES[out_dtype], "shape": list(e.shape), "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)
    tmp = path + ".tmp"
    with _created(tmp) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    filler = RecordFiller(tmp)
    try:
        at = 8 + len(raw)
        ring = [page_aligned_empty(SLAB + 4096) for _ in range(3)]
        for e, _, out_dtype, _ in shard:                # the next slab is read while this one is written
            dt = torch_dtype(out_dtype)
            slab = SLAB // 2 if out_dtype != e.dtype else SLAB
            at += filler.fill(at, prefetched(t for _, t in slab_values(storage, e, slab, dt, ring, base=at)),
                              progress)
        filler.close()
    except BaseException:
        filler.abort()
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


SLAB = 64 << 20

def find_model(src: str | os.PathLike[str], module: str | None = None) -> str:
    """The key of the subtree of liferaft checkpoint ``src`` that ``convert(..., "hf")`` exports as the model ("" for
    the whole checkpoint): ``module`` if given and holding tensors, else the one ``nn.Module`` the checkpoint
    recorded (``to_hf``). Reads the manifest only; OptionsError when there are several candidates or none."""
    return model_subtree(open_checkpoint(resolve(src)), module)[0]


def to_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, module: str | None = None,
          config: str | os.PathLike[str] | None = None, max_shard_bytes: int = 5 << 30, dtype: str | None = None,
          keys: Sequence[str] | None = None, rename: Sequence[tuple[str, str]] | None = None,
          progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Export one model of liferaft checkpoint ``src`` as a Hugging Face folder ``dst`` that
    ``from_pretrained(dst)`` loads as it is: the tensors of the model's subtree only (``model_subtree``: the
    ``nn.Module`` the checkpoint recorded, or ``module``), named as in the module's own state dict (its key in the
    checkpoint stripped); no optimizer state, RNG, step or other values. Written as ``model.safetensors``, or
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``. ``config``: a ``config.json``, or
    a folder whose config, tokenizer and other non-weight files are copied; without it, the files recorded when the
    checkpoint was imported from an HF folder. ``dtype`` casts floating-point tensors (and the config's dtype).
    ``keys``/``rename`` select and rename by the module's own names."""
    storage = with_references(resolve(src))
    m = open_checkpoint(storage)
    prefix, what = model_subtree(m, module)
    rn = _renamer(rename)
    cut = len(prefix) + 1 if prefix else 0
    pairs = [(e, rn(e.key[cut:])) for e in m.tensors if e.kind == "tensor" and (not prefix or e.key.startswith(
        prefix + ".")) and _selected(e.key[cut:], keys)]
    if not pairs:
        raise OptionsError(f"no tensor to export under {prefix!r}" + (f" matching {list(keys)}" if keys else ""))
    _refuse_per_rank([e for e, _ in pairs])
    hf = m.extra.get("hf") if isinstance(m.extra.get("hf"), dict) else {}
    contents, note = plan_config(config, hf.get("files"), dtype)     # every name checked before a byte is written
    files, total = _write_safetensors(storage, m, pairs, dst, max_shard_bytes, dtype, progress)
    extra_files = write_config(contents, os.fspath(dst))
    left = sum(1 for e in m.tensors if e.kind != "tensor" and (not prefix or e.key.startswith(prefix + "."))) + \
        sum(1 for v in m.values if not prefix or v.key.startswith(prefix + "."))
    notes = (f"module {prefix!r} ({what})" if prefix else f"{what}",) + \
        ((f"{left} non-tensor entr{'y' if left == 1 else 'ies'} of the module left out",) if left else ()) + (note,)
    return ConvertReport(files=tuple(files + extra_files), tensors=len(pairs), bytes=total, module=prefix,
                         notes=notes)


def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
                     rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a safetensors file or Hugging Face folder (single or sharded) into a liferaft checkpoint at ``dst``
    (keys unchanged unless renamed; nested by nothing: a flat dict). A folder's other files (config, tokenizer:
    ``hf_folder.recorded_files``) are recorded in the manifest's metadata (``"hf"``), so ``to_hf`` brings them back."""
    import dataclasses

    import liferaft

    rn = _renamer(rename)
    state = {rn(k): t for k, t in safetensors_state(src).items() if _selected(k, keys)}
    if os.path.isdir(src):              # its config (and tokenizer, ...) files, for an export back to HF
        recorded = recorded_files(os.fspath(src))
        if recorded:
            opts = options or liferaft.SaveOptions()
            meta = dict(opts.metadata)
            meta.setdefault("hf", {"source": os.path.abspath(src), "files": recorded})
            options = dataclasses.replace(opts, metadata=meta)
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=len(state), bytes=res.total_bytes)


def _export_source(src: str | os.PathLike[str], keys: Sequence[str] | None) -> tuple[Any, Any, list[Any], list[Any]]:
    """(storage, manifest, tensor entries, value entries) of the keys of liferaft checkpoint ``src`` an export
    takes, their files checked present."""
    storage = with_references(resolve(src))
    m = open_checkpoint(storage)
    tensors = [e for e in m.tensors if _selected(e.key, keys)]
    values = [v for v in m.values if _selected(v.key, keys)]
    if keys and not tensors and not values:
        raise OptionsError(f"no key of the checkpoint matches {list(keys)}")
    check_files(storage, m, {c.file for e in tensors for c in e.chunks})
    return storage, m, tensors, values


def _plain(v: Any) -> Any:
    """A value entry decoded for another format (no pickles; per-rank values as a plain tuple)."""
    from liferaft.core.native import decode_entry_value

    x = decode_entry_value(v, False)
    return tuple(x) if isinstance(x, tuple) else x


def _out_dtype(e: Any, cast: torch.dtype | None) -> torch.dtype:
    dt = torch_dtype(e.dtype)
    return cast if cast is not None and dt.is_floating_point else dt


def _ids(tree: Any, path: tuple[Any, ...], out: dict[int, tuple[Any, ...]]) -> None:
    """Where each tensor lies in ``tree`` (by identity): paths as built, list positions included."""
    if isinstance(tree, torch.Tensor):
        out[id(tree)] = path
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _ids(v, path + (k,), out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _ids(v, path + (i,), out)


def to_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
             rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
             progress: Callable[[int], None] | None = None, slab_bytes: int = SLAB) -> ConvertReport:
    """Export to one ``torch.save`` file, streamed (``tools.torch_file``: about three slabs of ``slab_bytes`` in
    memory, not the state), in the saved nesting; with ``rename`` a flat dict of the renamed keys. Stateful objects
    come out as their state dicts, values that differed per saving rank as tuples."""
    from liferaft.core.native import read_full
    from liferaft.formats.torch_file import placeholder, with_crc, write_torch_file
    from liferaft.staging.pool import page_aligned_empty
    from liferaft.state.tree import build_tree
    from liferaft.state.values import as_leaf
    from liferaft.tools._slabs import prefetched, slab_values

    storage, m, tensors, values = _export_source(src, keys)
    _refuse_per_rank(tensors)
    rn, cast, flat = _renamer(rename), torch_dtype(dtype) if dtype else None, bool(rename)
    leaves: dict[tuple[Any, ...], Any] = {}
    fills: dict[int, Any] = {}
    for e in tensors:
        where = (rn(e.key),) if flat else e.path
        if e.kind == "bytes":
            leaves[where] = as_leaf(e.kind, read_full(storage, [e], 32 << 20)[0])
            continue
        t = leaves[where] = placeholder(tuple(e.shape), _out_dtype(e, cast))
        fills[id(t)] = e
    for v in values:
        leaves[(rn(v.key),) if flat else v.path] = _plain(v)
    if len(leaves) != len(tensors) + len(values):
        raise OptionsError("the renaming maps two keys to one name")
    if flat:
        tree: Any = {k[0]: x for k, x in leaves.items()}
    else:
        kinds = {c.path: c.kind for c in m.containers}
        needed = {p[:i] for p in leaves for i in range(len(p))}
        tree = build_tree({p: k for p, k in kinds.items() if p in needed}, leaves,
                          {c.path: c.children for c in m.containers if c.children is not None})
    paths: dict[int, tuple[Any, ...]] = {}
    _ids(tree, (), paths)
    ring = [page_aligned_empty(slab_bytes + 4096) for _ in range(3)]

    def values_of(e: Any, dt: torch.dtype) -> Any:             # read (and CRC) the next slab while one is written
        return lambda at, crc: prefetched(with_crc((t for _, t in slab_values(storage, e, slab_bytes, dt, ring,
                                                                                base=at)), crc))
    jobs = [(paths[i], values_of(e, _out_dtype(e, cast))) for i, e in fills.items()]
    size = write_torch_file(os.fspath(dst), tree, jobs, progress)
    return ConvertReport(files=(os.fspath(dst),), tensors=len(tensors), bytes=size)


def to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
           rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
           progress: Callable[[int], None] | None = None, slab_bytes: int = SLAB) -> ConvertReport:
    """Export to a PyTorch DCP checkpoint, streamed (``tools.dcp_format.write_dcp``: each tensor as row-slab
    chunks of about ``slab_bytes``, the next read while one is written). Keys are the liferaft keys (renamed if asked),
    with the saved nesting recorded as DCP does, so ``dcp.load`` into the same nested state and
    ``dcp_to_torch_save`` both work; numpy arrays become tensors."""
    from liferaft.core.native import read_full
    from liferaft.formats.dcp import DcpItem, write_dcp
    from liferaft.staging.pool import page_aligned_empty
    from liferaft.state.values import as_leaf
    from liferaft.tools._slabs import prefetched, slab_values

    storage, m, tensors, values = _export_source(src, keys)
    _refuse_per_rank(tensors)
    rn, cast = _renamer(rename), torch_dtype(dtype) if dtype else None
    ring = [page_aligned_empty(slab_bytes + 4096) for _ in range(3)]
    kinds = {c.path: c.kind for c in m.containers}

    def dcp_path(p: tuple[Any, ...]) -> tuple[Any, ...]:         # DCP: ints only for list positions
        return tuple(x if isinstance(x, int) and kinds.get(p[:i]) in ("list", "tuple") else str(x)
                     for i, x in enumerate(p))
    items = []
    for e in tensors:
        path = tuple(rn(e.key).split(".")) if rename else dcp_path(e.path)
        if e.kind == "bytes":
            items.append(DcpItem(rn(e.key), path, value=as_leaf(e.kind, read_full(storage, [e], 32 << 20)[0])))
            continue

        def produce(e: Any = e) -> Any:
            for box, t in slab_values(storage, e, slab_bytes, _out_dtype(e, cast), ring):
                yield box[0], t
        items.append(DcpItem(rn(e.key), path, _out_dtype(e, cast), tuple(e.shape), produce))
    for v in values:
        items.append(DcpItem(rn(v.key), tuple(rn(v.key).split(".")) if rename else dcp_path(v.path),
                             value=_plain(v)))
    if len({i.key for i in items}) != len(items):
        raise OptionsError("the renaming maps two keys to one name")
    size = write_dcp(dst, items, progress, prefetch=prefetched)
    return ConvertReport(files=(os.fspath(dst),), tensors=len(tensors), bytes=size)


def _flat_selection(flat_items: Any, keys: Sequence[str] | None, rename: Sequence[tuple[str, str]] | None) -> dict:
    rn = _renamer(rename)
    out = {rn(k): v for k, v in flat_items if _selected(k, keys)}
    if keys and not out:
        raise OptionsError(f"no key of the source matches {list(keys)}")
    return out


def from_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
               rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a ``torch.save`` file (loaded with ``weights_only=True`` and memory-mapped: no code runs, the
    tensors are read once, by the save) into a liferaft checkpoint, nesting kept; with ``keys`` or ``rename`` a
    flat dict of the chosen (renamed) keys."""
    import liferaft
    from liferaft.state.flatten import flatten

    try:
        state = torch.load(os.fspath(src), weights_only=True, mmap=True, map_location="cpu")
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(os.fspath(src), weights_only=True, map_location="cpu")   # legacy (non-zip) format
    if not isinstance(state, dict):
        state = {"state": state}
    if keys or rename:
        f = flatten(state)
        items = [(leaf.key, leaf.parts[0][1]) for leaf in f.tensors] + [(k, v) for k, _, v in f.values]
        state = _flat_selection(items, keys, rename)
    n = len(flatten(state).tensors)
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=n, bytes=res.total_bytes)


def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
             rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a PyTorch DCP checkpoint, streamed: its chunks are memory-mapped where DCP's blobs hold them
    (``tools.dcp_format``; values unpickled with ``weights_only=True``) and saved as they lie (a tensor DCP
    stored in several chunks becomes a ``Sharded`` with those boxes); nesting from DCP's record of it, or a flat
    dict with ``keys``/``rename``."""
    import liferaft
    from liferaft.formats.dcp import DcpCheckpoint
    from liferaft.state.sharded import Sharded
    from liferaft.state.tree import nest

    ck = DcpCheckpoint(src)
    leaves: list[tuple[str, Any]] = []
    for key, t in ck.tensors.items():
        if not _selected(key, keys):
            continue
        pieces = [(c.offsets, ck.chunk(key, c)) for c in t.chunks if 0 not in c.sizes]
        covered = sum(math.prod(p.shape) for _, p in pieces)
        if covered != math.prod(t.shape):
            raise CorruptCheckpointError(f"{ck.folder}: key {key!r}: the saved chunks cover {covered} of the "
                                         f"{math.prod(t.shape)} elements of {list(t.shape)}; the DCP checkpoint "
                                         "is incomplete")
        if len(pieces) == 1 and tuple(pieces[0][1].shape) == t.shape:
            leaves.append((key, pieces[0][1]))
        elif not pieces:                                    # an empty tensor
            leaves.append((key, torch.empty(t.shape, dtype=t.dtype)))
        else:
            leaves.append((key, Sharded(pieces[0][1], t.shape, pieces[0][0], more=pieces[1:])))
    leaves += [(key, ck.value(key)) for key in ck.values if _selected(key, keys)]
    if keys or rename or not ck.paths:
        state: Any = _flat_selection(leaves, keys, rename)
    else:
        state = nest({ck.paths.get(k, (k,)): v for k, v in leaves})
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=sum(1 for k, v in leaves if k in ck.tensors),
                         bytes=res.total_bytes)


FORMATS = ("liferaft", "safetensors", "hf", "torch", "dcp")


def detect_format(src: str | os.PathLike[str]) -> str:
    """What ``src`` holds: ``tools.formats.detect`` (the one detector every tool uses)."""
    from liferaft.formats.detect import detect

    return detect(src)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], to: ConvertFormat, *,
            source: ConvertFormat | None = None, keys: Sequence[str] | None = None,
            rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
            max_shard_bytes: int = 5 << 30, module: str | None = None,
            config: str | os.PathLike[str] | None = None, options: SaveOptions | None = None,
            progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Convert ``src`` (format ``source``, detected when not given: ``tools.formats.detect``) to ``to``, each one of
    "liferaft", "safetensors", "torch", "dcp" — or, as ``to``, "hf": a Hugging Face model folder
    ``from_pretrained`` loads (``to_hf``: one module's weights, its config), where "safetensors" writes every
    tensor under its full key. Streams in bounded memory. Between two formats other than liferaft (DCP → HF, say)
    the state goes through a temporary liferaft checkpoint next to ``dst`` (disk space: the state's size once
    more), removed afterwards; ``keys`` and ``rename`` then apply on the way in. ``keys``: keys, key prefixes or globs to keep (``formats.base.matches``);
    ``rename``: ``(regex, replacement)`` pairs applied in order; ``dtype``: cast floating-point tensors on export;
    ``max_shard_bytes``: per safetensors shard; ``module``, ``config``: of an ``hf`` export; ``options``:
    ``SaveOptions`` of an import; ``progress(nbytes)`` called as an export writes."""
    src_fmt = source or detect_format(src)
    src_fmt = "safetensors" if src_fmt == "hf" else src_fmt
    for f in (src_fmt, to):
        if f not in FORMATS:
            raise OptionsError(f"unknown format {f!r}; one of {', '.join(FORMATS)}")
    if src_fmt == to == "liferaft":
        raise OptionsError("both sides are liferaft checkpoints: nothing to convert (copy the folder, or use "
                           "liferaft.save with SaveOptions to rewrite one)")
    if (module is not None or config is not None) and to != "hf":
        raise OptionsError("module and config are for an export to a Hugging Face folder (--to hf); for other "
                           "formats select keys with --key and strip a prefix with --rename")
    if src_fmt != "liferaft" and to != "liferaft":          # through a temporary liferaft checkpoint
        import shutil
        import tempfile

        parent = os.path.dirname(os.path.abspath(os.fspath(dst)))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".liferaft-convert-", dir=parent)
        try:
            mid = os.path.join(tmp, "ck")
            convert(src, mid, "liferaft", source=src_fmt, keys=keys, rename=rename, options=options)
            return convert(mid, dst, to, source="liferaft", dtype=dtype, max_shard_bytes=max_shard_bytes,
                           module=module, config=config, progress=progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if src_fmt == "liferaft":
        if to == "hf":
            return to_hf(src, dst, module=module, config=config, max_shard_bytes=max_shard_bytes, dtype=dtype,
                         keys=keys, rename=rename, progress=progress)
        if to == "safetensors":
            return to_safetensors(src, dst, max_shard_bytes=max_shard_bytes, dtype=dtype, keys=keys, rename=rename,
                                  progress=progress)
        return {"torch": to_torch, "dcp": to_dcp}[to](src, dst, keys=keys, rename=rename, dtype=dtype,
                                                      progress=progress)
    if dtype is not None:
        raise OptionsError("dtype casts on export only (an import keeps the source's dtypes)")
    fn = {"safetensors": from_safetensors, "torch": from_torch, "dcp": from_dcp}[src_fmt]
    return fn(src, dst, keys=keys, rename=rename, options=options)
