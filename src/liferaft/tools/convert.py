"""Move checkpoints between formats: liferaft ↔ safetensors (single file or sharded with
``model.safetensors.index.json``), ↔ ``torch.save`` files (read with ``weights_only=True``) and ↔ PyTorch DCP;
liferaft → a Hugging Face model folder that ``from_pretrained`` loads (``to_hf``: the one module's weights under its
own names, its config and tokenizer files); ``convert`` picks the direction (docs/cli/convert.md).

Every direction streams, holding a few 64 MiB slabs, never the state: the exports (``tools.export``) read each
tensor in row slabs through the reader protocol; the imports here memory-map the source (safetensors and
``torch.save`` files as they are, DCP chunks where DCP's blobs keep their bytes) and save from the mapping with
``liferaft.save``. Keys can be selected (keys, prefixes or globs) and renamed (regex) in every direction; the results
are checked against the ``safetensors`` package, ``torch.load`` and DCP's own loader in the tests.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from liferaft.core.open import in_call, open_reader
from liferaft.errors import CorruptCheckpointError, OptionsError
from liferaft.formats.base import check_patterns, matches, select
from liferaft.formats.hf_folder import recorded_files
from liferaft.formats.safetensors import safetensors_state
from liferaft.formats.torch_file import torch_file_state, torch_file_tree
from liferaft.options import ConvertFormat, SaveOptions, check_options, check_path
from liferaft.tools._dest import check_destination, check_dtype
from liferaft.tools.export import (  # noqa: F401 - the API of this module too
    INDEX,
    SLAB,
    ConvertReport,
    check_renamed,
    find_model,
    renamer,
    to_dcp,
    to_hf,
    to_safetensors,
    to_torch,
)


@in_call
def from_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
                     rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a safetensors file or Hugging Face folder (single or sharded) into a liferaft checkpoint at ``dst``
    (keys unchanged unless renamed; nested by nothing: a flat dict). A folder's other files (config, tokenizer:
    ``hf_folder.recorded_files``) are recorded in the manifest's metadata (``"hf"``), so ``to_hf`` brings them back."""
    check_destination(src, dst, "liferaft")
    import dataclasses

    import liferaft

    rn = renamer(rename)
    chosen = {k: t for k, t in safetensors_state(src).items() if matches(k, keys)}
    check_renamed((k, rn(k)) for k in chosen)
    state = {rn(k): t for k, t in chosen.items()}
    if os.path.isdir(src):              # its config (and tokenizer, ...) files, for an export back to HF
        recorded = recorded_files(os.fspath(src))
        if recorded:
            opts = options or liferaft.SaveOptions()
            meta = dict(opts.metadata)
            meta.setdefault("hf", {"source": os.path.abspath(src), "files": recorded})
            options = dataclasses.replace(opts, metadata=meta)
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=len(state), bytes=res.total_bytes)


def _flat_selection(flat_items: Any, keys: Sequence[str] | None, rename: Sequence[tuple[str, str]] | None) -> dict:
    rn = renamer(rename)
    chosen = [(k, v) for k, v in flat_items if matches(k, keys)]
    check_renamed((k, rn(k)) for k, _ in chosen)
    out = {rn(k): v for k, v in chosen}
    if keys and not out:
        raise OptionsError(f"no key of the source matches {list(keys)}")
    return out


@in_call
def from_torch(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
               rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a ``torch.save`` file into a liferaft checkpoint, nesting kept; with ``keys`` or ``rename`` a flat dict
    of the chosen (renamed) keys. Read as the torch reader reads it (``formats.torch_file.torch_file_state``:
    ``weights_only=True``, memory-mapped, so no code runs and the tensors are read once, by the save; a file
    weights_only refuses raises PickleNotAllowedError, a damaged one CorruptCheckpointError, naming the file), and
    keyed as it keys it (``torch_file_tree``: a top-level list's items are keys ``0``, ``1``, ...)."""
    check_destination(src, dst, "liferaft")
    import liferaft
    from liferaft.state.flatten import flatten

    state = torch_file_tree(torch_file_state(src))
    if keys or rename:
        f = flatten(state)
        items = [(leaf.key, leaf.parts[0][1]) for leaf in f.tensors] + [(k, v) for k, _, v in f.values]
        state = _flat_selection(items, keys, rename)
    n = len(flatten(state).tensors)
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=n, bytes=res.total_bytes)


@in_call
def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
             rename: Sequence[tuple[str, str]] | None = None, options: Any = None) -> ConvertReport:
    """Import a PyTorch DCP checkpoint, streamed: its chunks are memory-mapped where DCP's blobs hold them
    (``formats.dcp.DcpCheckpoint``; values unpickled with ``weights_only=True``) and saved as they lie (a tensor DCP
    stored in several chunks becomes a ``Sharded`` with those boxes); nesting from DCP's record of it, or a flat
    dict with ``keys``/``rename``."""
    check_destination(src, dst, "liferaft")
    import liferaft
    from liferaft.formats.dcp import DcpCheckpoint
    from liferaft.state.sharded import Sharded
    from liferaft.state.tree import nest

    ck = DcpCheckpoint(src)
    leaves: list[tuple[str, Any]] = []
    for key, t in ck.tensors.items():
        if not matches(key, keys):
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
    leaves += [(key, ck.value(key)) for key in ck.values if matches(key, keys)]
    if keys or rename or not ck.paths:
        state: Any = _flat_selection(leaves, keys, rename)
    else:
        state = nest({ck.paths.get(k, (k,)): v for k, v in leaves})
    res = liferaft.save(dst, state, options=options)
    return ConvertReport(files=(res.path,), tensors=sum(1 for k, v in leaves if k in ck.tensors),
                         bytes=res.total_bytes)


FORMATS = ("liferaft", "safetensors", "hf", "torch", "dcp")


def detect_format(src: str | os.PathLike[str]) -> str:
    """What ``src`` holds: ``formats.detect.detect`` (the one detector every tool uses)."""
    from liferaft.formats.detect import detect

    return detect(src)


@in_call
def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], to: ConvertFormat, *,
            source: ConvertFormat | None = None, keys: Sequence[str] | None = None,
            rename: Sequence[tuple[str, str]] | None = None, dtype: str | None = None,
            max_shard_bytes: int = 5 << 30, module: str | None = None,
            config: str | os.PathLike[str] | None = None, options: SaveOptions | None = None,
            progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Convert ``src`` (format ``source``, detected when not given: ``formats.detect.detect``) to ``to``, each one of
    "liferaft", "safetensors", "torch", "dcp" — or, as ``to``, "hf": a Hugging Face model folder
    ``from_pretrained`` loads (``to_hf``: one module's weights, its config), where "safetensors" writes every
    tensor under its full key. Streams in bounded memory. Between two formats other than liferaft (DCP → HF, say)
    the state goes through a temporary liferaft checkpoint next to ``dst`` (disk space: the state's size once
    more), removed afterwards; ``keys`` and ``rename`` then apply on the way in. ``keys``: keys, key prefixes or globs to keep (``formats.base.matches``);
    ``rename``: ``(regex, replacement)`` pairs applied in order; ``dtype``: cast floating-point tensors on export;
    ``max_shard_bytes``: per safetensors shard; ``module``, ``config``: of an ``hf`` export; ``options``:
    ``SaveOptions`` of an import; ``progress(nbytes)`` called as an export writes."""
    check_path(src, "convert(src=...)")
    check_path(dst, "convert(dst=...)")
    check_dtype(dtype)
    if options is not None:
        check_options(options, SaveOptions, "convert")
    src_fmt = source or detect_format(src)
    src_fmt = "safetensors" if src_fmt == "hf" else src_fmt
    if check_patterns(keys):                 # every pattern must select something (a typo is not "nothing to do")
        reader = open_reader(src, lazy=True)     # (its keys only: no chunk table read)
        try:
            select(reader.keys, keys, url=reader.url)
        finally:
            reader.close()
    for f in (src_fmt, to):
        if f not in FORMATS:
            raise OptionsError(f"unknown format {f!r}; one of {', '.join(FORMATS)}")
    if src_fmt == to == "liferaft":
        raise OptionsError("both sides are liferaft checkpoints: nothing to convert (copy the folder, or use "
                           "liferaft.save with SaveOptions to rewrite one)")
    if (module is not None or config is not None) and to != "hf":
        raise OptionsError("module and config are for an export to a Hugging Face folder (--to hf); for other "
                           "formats select keys with --key and strip a prefix with --rename")
    check_destination(src, dst, to)         # before anything is read or written (tools._dest)
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
