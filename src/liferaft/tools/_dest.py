"""Where a conversion may write: checked before anything is read or written (``check_destination``).

A destination is never the source, inside it or around it (compared by real paths, links followed), and never
something that already holds data the conversion would destroy: a ``torch.save`` file (``--to torch``) must not
exist; a folder target (safetensors, hf, dcp, liferaft) must not be anything but a folder (a file, FIFO or device
node there is refused, never replaced), and an existing folder must be empty — or be what the conversion
documents writing into: for ``--to safetensors``/``--to hf`` any folder but a checkpoint whose weight files (if any)
an earlier liferaft export wrote (marked ``written_by: liferaft`` in their headers, ``EXPORT_MARK``): those are
replaced (docs/cli/convert.md); weights liferaft did not write (a downloaded model, a link or FIFO at a weight
file's name: a hub cache's snapshot links its weights) are refused, never overwritten; a committed liferaft checkpoint for
``--to liferaft`` (``liferaft.save`` then refuses it unless ``SaveOptions(overwrite=True)``), DCP's own names for
``--to dcp`` (an interrupted export's files are replaced; a whole DCP checkpoint ``write_dcp`` refuses).
The output folder may be a link to a folder (followed once, as documented).
"""

from __future__ import annotations

import os
import re
import stat

from liferaft.errors import CheckpointExistsError, OptionsError

#: The names a DCP export writes (its data file, its metadata and their temporaries).
_DCP_OWN = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp[^/]*)?")
#: The files a safetensors / hf export writes (and removes, of an earlier export of its own).
EXPORT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
#: Files of model weights in a folder (any framework's): an export never replaces one it did not write. (A ``.bin``
#: only when named as weights: ``pytorch_model*.bin``, ``adapter_model.bin``; Trainer's ``training_args.bin`` is none.)
_WEIGHTS = re.compile(r".+\.(safetensors|pt|pth|ckpt|h5|msgpack|gguf)|.*model.*\.bin|.+\.safetensors\.index\.json"
                      r"|.*model.*\.bin\.index\.json", re.IGNORECASE)
#: How a liferaft export's files begin: a safetensors header (after its 8-byte length) and the index.
EXPORT_MARK = {"header": b'{"__metadata__":{"format":"pt","written_by":"liferaft"}',
               "index": b'{\n  "metadata": {\n    "written_by": "liferaft",'}


def _ours(folder: str, name: str) -> bool:
    """Whether ``folder/name`` is a weight file a liferaft export wrote (a regular file whose first bytes carry
    ``EXPORT_MARK``). A link there is not (a Hugging Face cache snapshot links its weights into its blobs), nor a
    FIFO or anything else: the export refuses the folder rather than replace them."""
    try:
        st = os.lstat(os.path.join(folder, name))
    except OSError:
        return True                             # (gone meanwhile)
    if stat.S_ISDIR(st.st_mode):
        return True                             # (no weights: the export names the folder in its way and refuses)
    if not stat.S_ISREG(st.st_mode):
        return False
    index = name.endswith(".json")
    mark = EXPORT_MARK["index" if index else "header"]
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        head = os.pread(fd, len(mark) + 8, 0)
    except OSError:                             # (swapped for a FIFO or a device since the lstat)
        return False
    finally:
        os.close(fd)
    return head[0 if index else 8:].startswith(mark)


def _inside(a: str, b: str) -> bool:
    """Whether real path ``a`` is ``b`` or lies under it."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_destination(src: str | os.PathLike[str], dst: str | os.PathLike[str], to: str) -> None:
    """OptionsError when ``dst`` is ``src``, lies inside it or contains it; CheckpointExistsError when ``dst``
    holds something a conversion to ``to`` would destroy (module docstring). Nothing is created."""
    s, d = os.path.realpath(os.fspath(src)), os.path.realpath(os.fspath(dst))
    if _inside(d, s) or _inside(s, d):
        where = "is the source" if d == s else "lies inside the source" if _inside(d, s) else "contains the source"
        raise OptionsError(f"the destination {os.fspath(dst)!r} {where} {os.fspath(src)!r}; nothing was "
                           "written. Choose a destination outside the source")
    dst = os.fspath(dst)
    if not os.path.lexists(dst):
        return
    if to == "torch":
        raise CheckpointExistsError(f"{dst!r} already exists; a --to torch export never replaces a file. "
                                    "Remove it first or choose another name")
    try:
        st = os.stat(dst)
    except OSError as e:
        raise CheckpointExistsError(f"{dst!r} exists but cannot be used as the output folder "
                                    f"({e.strerror}); remove it or choose another name") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointExistsError(f"{dst!r} already exists and is not a folder; a --to {to} export "
                                    "writes a folder and never replaces a file. Remove it or choose another name")
    names = os.listdir(dst)
    if not names:
        return
    held = "COMMIT" in names or ".metadata" in names          # a liferaft or DCP checkpoint
    if to in ("safetensors", "hf") and not held:
        foreign = sorted(n for n in names if _WEIGHTS.fullmatch(n) and not (EXPORT_FILES.fullmatch(n)
                                                                             and _ours(dst, n)))
        if foreign:
            raise CheckpointExistsError(
                f"the folder {dst!r} holds model weights liferaft did not export ({len(foreign)} file(s), e.g. "
                f"{foreign[0][:80]!r}: a downloaded model, a link into a hub cache?); a --to {to} export replaces only "
                "the weight files of an earlier liferaft export (marked in their headers since 2026-12-06: an older "
                "export's are not). Choose another destination, or remove those files first")
        return              # documented: an earlier export's weights are replaced
    if to == "liferaft" and "COMMIT" in names:
        return                                          # liferaft.save refuses it unless overwrite=True
    if to == "dcp" and all(_DCP_OWN.fullmatch(n) for n in names):
        return          # an interrupted DCP export's files (replaced, never written through); a whole DCP
        #                 checkpoint (.metadata) is refused by write_dcp: "already holds a DCP checkpoint"
    raise CheckpointExistsError(f"the folder {dst!r} is not empty ({len(names)} entries, e.g. "
                                f"{min(names)[:80]!r}"
                                + (", a checkpoint" if held else "") + f"); a --to {to} export writes into "
                                + ("a folder that holds no checkpoint" if to in ("safetensors", "hf") else
                                   "an empty or new folder") + ". Choose another destination or empty it")


def check_dtype(dtype: object) -> None:
    """OptionsError naming ``--dtype`` (``dtype=``) unless it is None or the name of a floating-point torch dtype
    ("bfloat16", "float16", ...): an export casts floating-point tensors to it, and a cast of weights to an integer
    or bool dtype would silently destroy them."""
    if dtype is None:
        return
    import torch

    dt = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise OptionsError(f"--dtype (dtype=): unknown dtype {str(dtype)[:80]!r}; give a floating-point torch "
                           "dtype such as bfloat16, float16 or float32")
    if not dt.is_floating_point:
        raise OptionsError(f"--dtype (dtype=): {dtype} is not a floating-point dtype; an export casts only "
                           "floating-point tensors, to bfloat16, float16, float32, float64 (or a float8 type)")
