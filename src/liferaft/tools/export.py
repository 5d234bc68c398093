"""Exports of a liferaft checkpoint to other formats, streamed in bounded memory, all read through the reader
protocol (``core.open.open_reader``; ``formats.base.Reader``): safetensors (``to_safetensors``; a Hugging Face
model folder, ``to_hf``), one ``torch.save`` file (``to_torch``) and PyTorch DCP (``to_dcp``).

Every export holds a few slabs, never the state: each tensor is read in row slabs (``tools._slabs``: the next slab
read by a prefetch thread while this one is written) into ring buffers lying on the output file's page
boundaries, and written into safetensors here directly (8-byte header length, JSON header, raw bytes;
page-aligned, O_DIRECT), into a ``torch.save`` archive whose records are filled in place
(``formats.torch_file``) or into DCP's format (``formats.dcp.write_dcp``). The checkpoint's files are checked
present and long enough once, before anything is written (``Reader.check_present``); the slab reads skip that
check. What only liferaft records comes through the reader: the nesting (``tree``), containers and metadata
(``info``), and for ``to_hf`` the manifest the model subtree is chosen from (``NativeReader.manifest``).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from liferaft.core.open import in_call, open_reader
from liferaft.errors import InvalidStateError, OptionsError
from liferaft.formats.base import Reader, TensorSpec, matches
from liferaft.formats.hf_folder import model_subtree, plan_config, write_config
from liferaft.formats.safetensors import ST_DTYPES
from liferaft.state.dtypes import torch_dtype
from liferaft.state.values import as_leaf
from liferaft.storage import files as files_io
from liferaft.storage import fsync_dir, resolve
from liferaft.tools._dest import EXPORT_FILES, check_destination, check_dtype
from liferaft.tools._slabs import prefetched, ring, slab_values

INDEX = "model.safetensors.index.json"
#: The row slabs an export reads and writes at a time.
SLAB = 64 << 20


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


def renamer(rename: Sequence[tuple[str, str]] | None) -> Callable[[str], str]:
    """A key renamed by ``rename``: ``(regex, replacement)`` pairs applied in order (``re.sub``). A pair that is
    not two strings, a pattern that does not compile or a replacement that refers to a group the pattern lacks:
    OptionsError naming it, before any key is renamed."""
    pats = []
    for pair in rename or ():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise OptionsError(f"rename= takes (regex, replacement) pairs of strings, got {pair!r}"[:300])
        try:
            p = re.compile(pair[0])
            p.sub(pair[1], "")                  # (checks the replacement's group references)
        except (re.error, RecursionError, OverflowError, IndexError) as e:
            raise OptionsError(f"rename: {pair[0]!r} -> {pair[1]!r} is not a valid regular expression and "
                               f"replacement: {e}") from None
        pats.append((p, pair[1]))

    def apply(key: str) -> str:
        for p, r in pats:
            try:
                key = p.sub(r, key)
            except (re.error, IndexError) as e:     # (a group the replacement names, seen at the first match)
                raise OptionsError(f"rename: {p.pattern!r} -> {r!r}: the replacement does not fit the pattern "
                                   f"({e}), at key {key[:200]!r}") from None
        return key
    return apply


def check_renamed(pairs: Iterable[tuple[str, str]]) -> None:
    """``(key, its new name)`` pairs: two keys given one name raise OptionsError naming both (never one dropped)."""
    seen: dict[str, str] = {}
    for key, name in pairs:
        other = seen.setdefault(name, key)
        if other != key:
            raise OptionsError(f"the renaming maps two keys to one name: {other!r} and {key!r} both become "
                               f"{name!r}; change the rename patterns (or select fewer keys)"[:600])


def open_liferaft(src: str | os.PathLike[str]) -> Reader:
    """Liferaft checkpoint ``src`` opened for an export (``open_reader`` of its storage: references to sibling
    checkpoints resolved, the manifest verified; anything else raises as a liferaft load would). Its chunk tables
    are read as the export reads (``lazy``), by windows of keys once the export gives its order
    (``Reader.read_order``): memory holds one window's chunk records, not the whole checkpoint's."""
    return open_reader(resolve(src), lazy=True)


def manifest_of(reader: Reader) -> Any:
    """The verified manifest of a liferaft checkpoint opened by ``open_reader`` (``NativeReader.manifest``)."""
    return reader.manifest  # type: ignore[attr-defined]


def refuse_per_rank(specs: Sequence[TensorSpec]) -> None:
    """An export writes each tensor under its plain name with its shape: a tensor stored per rank (its copies
    differed between the saving ranks; stored as ``[ranks, *shape]``) has no one value to write, so it is
    refused, naming it, before anything is written (docs/cli/convert.md)."""
    bad = [s for s in specs if s.per_rank is not None]
    if bad:
        e = bad[0]
        others = ", ".join(repr(b.key) for b in bad[1:4]) + (", ..." if len(bad) > 4 else "")
        more = f" (and {len(bad) - 1} more: {others})" if len(bad) > 1 else ""
        raise OptionsError(
            f"key {e.key!r}{more} was stored per rank: its copies differed between the {len(e.per_rank or ())} "
            f"saving ranks, so there is no one {list(e.shape[1:])} tensor to export under its name; nothing was "
            "written. Leave it out by selecting the other keys with --key GLOB (keys=...), or read each rank's copy "
            "with liferaft.read")


@in_call
def to_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, max_shard_bytes: int = 5 << 30,
                   dtype: str | None = None, keys: Sequence[str] | None = None,
                   rename: Sequence[tuple[str, str]] | None = None,
                   progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Export the tensors of liferaft checkpoint ``src`` — all of them, under their full keys — to the folder
    ``dst`` as safetensors: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` plus ``model.safetensors.index.json``. ``dtype`` (e.g. "bfloat16") casts floating-point
    tensors. (``to_hf`` writes a folder ``from_pretrained`` loads: one module's weights, its config.)"""
    check_destination(src, dst, "safetensors")
    check_dtype(dtype)
    reader = open_liferaft(src)
    rn = renamer(rename)
    picked = [(k, rn(k)) for k, s in reader.tensors.items() if s.kind == "tensor" and matches(k, keys)]
    if keys and not picked:
        raise OptionsError(f"no tensor of the checkpoint matches {list(keys)}")
    refuse_per_rank([reader.tensors[k] for k, _ in picked])
    files, total = _write_safetensors(reader, picked, dst, max_shard_bytes, dtype, progress)
    return ConvertReport(files=tuple(files), tensors=len(picked), bytes=total)


def _write_safetensors(reader: Reader, pairs: list[tuple[str, str]], dst: str | os.PathLike[str],
                       max_shard_bytes: int, dtype: str | None,
                       progress: Callable[[int], None] | None) -> tuple[list[str], int]:
    """Write the tensors ``pairs`` ((key, name)) of ``reader`` as ``model.safetensors`` or shards of at most
    ``max_shard_bytes`` with their index in ``dst``; weight files of an earlier export there are removed.
    Returns (file names, tensor bytes)."""
    cast = torch_dtype(dtype) if dtype else None
    picked = []
    for key, name in pairs:
        spec = reader.tensors[key]
        out_dtype = dtype if cast is not None and torch_dtype(spec.dtype).is_floating_point else spec.dtype
        if out_dtype not in ST_DTYPES:
            raise InvalidStateError(f"key {key!r}: dtype {out_dtype} has no safetensors name")
        size = int(np.prod(spec.shape, dtype=np.int64)) * torch.empty(0, dtype=torch_dtype(out_dtype)).element_size()
        picked.append((key, name, out_dtype, size))
    check_renamed((p[0], p[1]) for p in picked)
    reader.read_order([p[0] for p in picked])
    reader.check_present([p[0] for p in picked])
    shards: list[list[Any]] = [[]]
    filled = 0                                  # bytes of the last shard (a running sum: linear in the keys)
    for p in picked:
        if shards[-1] and filled + p[3] > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(p)
        filled += p[3]
    os.makedirs(dst, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name in [*names, *(n + ".tmp" for n in names), *([INDEX, INDEX + ".tmp"] if len(shards) > 1 else [])]:
        files_io.check_target(os.path.join(dst, name))     # a folder in the way: refused before any byte is written
    # an earlier export's weights go first, the index first of all: an export interrupted midway leaves no
    # complete-looking mixture of its shards and the earlier ones (check_destination: they are liferaft's own)
    old = sorted((n for n in os.listdir(dst) if EXPORT_FILES.fullmatch(n)
                  and not stat.S_ISDIR(os.lstat(os.path.join(dst, n)).st_mode)), key=lambda n: n != INDEX)
    for name in old:
        os.unlink(os.path.join(dst, name))
    if old:
        fsync_dir(os.fspath(dst))
    files, total, weight_map = [], 0, {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(reader, os.path.join(dst, name), shard, progress)
        files.append(name)
        for _, key, _, size in shard:
            weight_map[key] = name
            total += size
    if len(shards) > 1:
        with _created(os.path.join(dst, INDEX + ".tmp")) as f:
            f.write(json.dumps({"metadata": {"written_by": "liferaft", "total_size": total}, "weight_map": weight_map},
                               indent=2).encode())
        files_io.put_in_place(os.path.join(dst, INDEX + ".tmp"), os.path.join(dst, INDEX))
        files.append(INDEX)
    return files, total


def _created(path: str) -> Any:
    """``path`` created anew for writing: whatever lay there (a link to elsewhere, a FIFO) removed first, never
    written through; a folder there is a FileAccessError naming it (``storage.files.create_exclusive``)."""
    fd, at = files_io.create_exclusive(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    os.close(at)
    return os.fdopen(fd, "wb")


def _write_shard(reader: Reader, path: str, shard: list[Any], progress: Callable[[int], None] | None = None) -> None:
    """One safetensors file, streamed: the header padded (with spaces, as the format allows) so that the data
    starts on a 4 KiB page, then each tensor in row slabs read into ring buffers on the file's page boundaries
    and written by ``RecordFiller`` (O_DIRECT for whole pages: through the page cache a write runs at a fraction
    of the disk's speed here). Written to ``path + ".tmp"``, fsynced, renamed."""
    from liferaft.formats.torch_file import RecordFiller

    header: dict[str, Any] = {"__metadata__": {"format": "pt", "written_by": "liferaft"}}
    pos = 0
    for key, name, out_dtype, size in shard:
        header[name] = {"dtype": ST_DTYPES[out_dtype], "shape": list(reader.tensors[key].shape),
                        "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)
    tmp = path + ".tmp"
    with _created(tmp) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    filler = RecordFiller(tmp)
    try:
        at = 8 + len(raw)
        buffers = ring(SLAB)
        for key, _, out_dtype, _ in shard:              # the next slab is read while this one is written
            dt = torch_dtype(out_dtype)
            slab = SLAB // 2 if out_dtype != reader.tensors[key].dtype else SLAB
            at += filler.fill(at, prefetched(t for _, t in slab_values(reader, key, slab, dt, buffers, base=at)),
                              progress)
        filler.close()
    except BaseException:
        filler.abort()
        os.unlink(tmp)
        raise
    files_io.put_in_place(tmp, path)        # a failure (a folder planted meanwhile) removes tmp, names path
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def find_model(src: str | os.PathLike[str], module: str | None = None) -> str:
    """The key of the subtree of liferaft checkpoint ``src`` that ``convert(..., "hf")`` exports as the model ("" for
    the whole checkpoint): ``module`` if given and holding tensors, else the one ``nn.Module`` the checkpoint
    recorded (``to_hf``). Reads the manifest only; OptionsError when there are several candidates or none."""
    return model_subtree(manifest_of(open_liferaft(src)), module)[0]


@in_call
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
    check_destination(src, dst, "hf")
    check_dtype(dtype)
    reader = open_liferaft(src)
    prefix, what = model_subtree(manifest_of(reader), module)
    rn = renamer(rename)
    cut = len(prefix) + 1 if prefix else 0

    def under(key: str) -> bool:
        return not prefix or key.startswith(prefix + ".")
    pairs = [(k, rn(k[cut:])) for k, s in reader.tensors.items() if s.kind == "tensor" and under(k)
             and matches(k[cut:], keys)]
    if not pairs:
        raise OptionsError(f"no tensor to export under {prefix!r}" + (f" matching {list(keys)}" if keys else ""))
    refuse_per_rank([reader.tensors[k] for k, _ in pairs])
    meta = reader.info.get("metadata") or {}
    hf = meta.get("hf") if isinstance(meta.get("hf"), dict) else {}
    contents, note = plan_config(config, hf.get("files"), dtype)     # every name checked before a byte is written
    files, total = _write_safetensors(reader, pairs, dst, max_shard_bytes, dtype, progress)
    extra_files = write_config(contents, os.fspath(dst))
    left = sum(1 for k, s in reader.tensors.items() if s.kind != "tensor" and under(k)) + \
        sum(1 for k in reader.values if under(k))
    notes = (f"module {prefix!r} ({what})" if prefix else f"{what}",) + \
        ((f"{left} non-tensor entr{'y' if left == 1 else 'ies'} of the module left out",) if left else ()) + (note,)
    return ConvertReport(files=tuple(files + extra_files), tensors=len(pairs), bytes=total, module=prefix,
                         notes=notes)


def _export_source(src: str | os.PathLike[str], keys: Sequence[str] | None) -> tuple[Reader, list[str], list[str]]:
    """(reader, tensor keys, value keys) of the keys of liferaft checkpoint ``src`` an export takes, their files
    checked present (once: the slab reads skip it)."""
    reader = open_liferaft(src)
    tensors = [k for k in reader.tensors if matches(k, keys)]
    values = [k for k in reader.values if matches(k, keys)]
    if keys and not tensors and not values:
        raise OptionsError(f"no key of the checkpoint matches {list(keys)}")
    reader.read_order(tensors)
    reader.check_present(tensors)
    refuse_per_rank([reader.tensors[k] for k in tensors])
    return reader, tensors, values


def _plain(reader: Reader, key: str) -> Any:
    """A plain value decoded for another format (no pickles; per-rank values as a plain tuple)."""
    x = reader.value(key)
    return tuple(x) if isinstance(x, tuple) else x


def _numpy_in(v: Any, at: str = "", depth: int = 0) -> tuple[str, Any] | None:
    """Where the first numpy array or scalar lies in the plain value ``v`` (``"['opt'][0]"``; "" for ``v``
    itself; a dict key counts), and it; None when there is none (or deeper than 100 levels: the weights_only check
    of ``_portable_values`` still sees it)."""
    if isinstance(v, (np.ndarray, np.generic)):
        return at, v
    if depth > 100:
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            hit = _numpy_in(k, f"{at} (the dict key {k!r})".lstrip(), depth + 1) or \
                _numpy_in(x, f"{at}[{k!r}]", depth + 1)
            if hit:
                return hit
    elif isinstance(v, (list, tuple, set, frozenset)):
        for i, x in enumerate(v):
            hit = _numpy_in(x, f"{at}[{i}]", depth + 1)
            if hit:
                return hit
    return None


def _portable_values(reader: Reader, keys: Sequence[str], to: str) -> dict[str, Any]:
    """The plain values ``keys`` decoded for an export to ``to`` ("torch" or "dcp", whose readers — liferaft's, and
    ``torch.load(weights_only=True)`` — unpickle them with ``weights_only``), each checked to load back that way
    before anything is written; else OptionsError naming the key. A numpy array or scalar inside a plain value
    (liferaft stores small ones exactly, as values) is refused rather than converted: weights_only refuses numpy's
    pickles, and writing it as a tensor or a list would change its type (or its dtype), so the round trip would
    not be exact — the user chooses how to store it."""
    import io

    out: dict[str, Any] = {}
    for k in keys:
        v = _plain(reader, k)
        hit = _numpy_in(v)
        if hit is not None:
            where, x = hit
            raise OptionsError(
                f"key {k!r}{' at ' + where if where else ''} holds a numpy "
                f"{'array' if isinstance(x, np.ndarray) else 'scalar'} ({x.dtype}): a {to} file stores it as a "
                "numpy pickle, which weights_only readers (liferaft's, torch.load(weights_only=True)) refuse, and "
                "storing it as a tensor or list would change its type; nothing was written. Store it in the state "
                "as a tensor (torch.from_numpy) or a Python list/number and save again, or leave the key out by "
                "selecting the others with --key GLOB (keys=...)")
        buf = io.BytesIO()
        torch.save(v, buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever weights_only refuses, the export refuses
            why = next((x.strip() for x in str(e).splitlines() if "Unsupported" in x), type(e).__name__)
            raise OptionsError(f"key {k!r} holds a {type(v).__name__} value that weights_only readers cannot read "
                               f"back from a {to} file ({why}); nothing was written. Store it as plain numbers, "
                               "strings, lists, tuples and dicts, or leave the key out with --key GLOB (keys=...)") \
                from None
        out[k] = v
    return out


def _whole(reader: Reader, key: str) -> Any:
    """A ``bytes`` tensor read whole, as the leaf it was in the state."""
    spec = reader.tensors[key]
    return as_leaf(spec.kind, reader.read_box(key, (tuple(0 for _ in spec.shape), tuple(spec.shape))))


def _out_dtype(spec: TensorSpec, cast: torch.dtype | None) -> torch.dtype:
    dt = torch_dtype(spec.dtype)
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


@in_call
def to_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
             rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
             progress: Callable[[int], None] | None = None, slab_bytes: int = SLAB) -> ConvertReport:
    """Export to one ``torch.save`` file, streamed (``formats.torch_file``: about three slabs of ``slab_bytes`` in
    memory, not the state), in the saved nesting (``Reader.tree``); with ``rename`` a flat dict of the renamed
    keys. Stateful objects come out as their state dicts, values that differed per saving rank as tuples; a plain
    value ``torch.load(weights_only=True)`` could not read back (numpy data inside it) is refused, naming the key,
    before anything is written (``_portable_values``)."""
    check_destination(src, dst, "torch")
    check_dtype(dtype)
    from liferaft.formats.torch_file import placeholder, with_crc, write_torch_file

    reader, tensors, values = _export_source(src, keys)
    rn, cast, flat = renamer(rename), torch_dtype(dtype) if dtype else None, bool(rename)
    check_renamed((k, rn(k)) for k in [*tensors, *values])
    leaves: dict[str, Any] = {}
    fills: dict[int, str] = {}
    for k in tensors:
        spec = reader.tensors[k]
        if spec.kind == "bytes":
            leaves[rn(k)] = _whole(reader, k)
            continue
        t = leaves[rn(k)] = placeholder(tuple(spec.shape), _out_dtype(spec, cast))
        fills[id(t)] = k
    for k, v in _portable_values(reader, values, "torch").items():
        leaves[rn(k)] = v
    tree = leaves if flat else reader.tree(leaves)
    paths: dict[int, tuple[Any, ...]] = {}
    _ids(tree, (), paths)
    buffers = ring(slab_bytes)

    def values_of(key: str, dt: torch.dtype) -> Any:             # read (and CRC) the next slab while one is written
        return lambda at, crc: prefetched(with_crc((t for _, t in slab_values(reader, key, slab_bytes, dt, buffers,
                                                                                base=at)), crc))
    jobs = [(paths[i], values_of(k, _out_dtype(reader.tensors[k], cast))) for i, k in fills.items()]
    size = write_torch_file(os.fspath(dst), tree, jobs, progress)
    return ConvertReport(files=(os.fspath(dst),), tensors=len(tensors), bytes=size)


@in_call
def to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
           rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
           progress: Callable[[int], None] | None = None, slab_bytes: int = SLAB) -> ConvertReport:
    """Export to a PyTorch DCP checkpoint, streamed (``formats.dcp.write_dcp``: each tensor as row-slab chunks of
    about ``slab_bytes``, the next read while one is written). Keys are the liferaft keys (renamed if asked), with
    the saved nesting recorded as DCP does, so ``dcp.load`` into the same nested state and ``dcp_to_torch_save``
    both work; numpy arrays stored as tensors (over ``INLINE_LIMIT``) become tensors; a plain value weights_only
    readers could not read back (numpy data inside it) is refused, naming the key, before anything is written
    (``_portable_values``)."""
    check_destination(src, dst, "dcp")
    check_dtype(dtype)
    from liferaft.formats.dcp_write import DcpItem, write_dcp

    reader, tensors, values = _export_source(src, keys)
    rn, cast = renamer(rename), torch_dtype(dtype) if dtype else None
    check_renamed((k, rn(k)) for k in [*tensors, *values])
    buffers = ring(slab_bytes)
    kinds = {c[0]: c[1] for c in reader.info.get("containers", ())}

    def dcp_path(key: str, p: tuple[Any, ...] | None) -> tuple[Any, ...]:    # DCP: ints only for list positions
        if rename or p is None:
            return tuple(rn(key).split("."))
        return tuple(x if isinstance(x, int) and kinds.get(p[:i]) in ("list", "tuple") else str(x)
                     for i, x in enumerate(p))
    items = []
    for k in tensors:
        spec = reader.tensors[k]
        if spec.kind == "bytes":
            items.append(DcpItem(rn(k), dcp_path(k, spec.path), value=_whole(reader, k)))
            continue

        def produce(k: str = k) -> Any:
            for box, t in slab_values(reader, k, slab_bytes, _out_dtype(reader.tensors[k], cast), buffers):
                yield box[0], t
        items.append(DcpItem(rn(k), dcp_path(k, spec.path), _out_dtype(spec, cast), tuple(spec.shape), produce))
    for k, v in _portable_values(reader, values, "dcp").items():
        items.append(DcpItem(rn(k), dcp_path(k, reader.values[k].path), value=v))
    size = write_dcp(dst, items, progress, prefetch=prefetched)
    return ConvertReport(files=(os.fspath(dst),), tensors=len(tensors), bytes=size)
