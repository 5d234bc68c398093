"""The one check of a ``torch.save`` archive's tensors before torch materializes any of them (for ``.pt`` files and
the blobs inside DCP shards): every storage backed by a record of its full size, every tensor inside its storage.

``torch.load(weights_only=True, mmap=True)`` refuses code, but trusts the sizes the pickle declares: a storage
declared larger than the zip record that holds it is mapped over the bytes that follow (the next tensor's record,
the zip directory: a silent wrong load), and a view may have more elements than its storage holds
(``torch.ones(1).expand(2**40)`` is a valid 1.5 KB file whose one tensor is 4 TiB once copied: ``read`` allocates
it, ``convert`` writes it). ``scan`` unpickles the archive's ``data.pkl`` with torch's own weights-only unpickler
and storages on the meta device (nothing is read, nothing allocated) and checks, before the real load:

- each storage's declared bytes fit the record ``<archive>/data/<key>`` that holds it (a record may not be missing);
- every record stored uncompressed, whole inside the file, apart from the others (``zipfiles.stored_records``),
  all in the folder of the first record, where ``data.pkl`` is read (as torch's reader takes the prefix);
- torch's own zip reader, which ``torch.load`` uses, seeing exactly those records at the same offsets with the
  same sizes (``_as_torch_reads``: a second central directory or a decoy record makes two readings of one file);
- each tensor's extent (the bytes its strides reach from its offset) within its storage, and the bytes all the
  file's tensors hold once copied at most ``SHARE_LIMIT`` times the bytes of the storages they view (plus 16 MiB):
  broadcast buffers (``zeros(1).expand(10)``, ``position_ids = arange(n).expand(1, -1)``) and tied weights read,
  an expansion bomb and one big storage under a hundred thousand keys are refused (``check_views``);
- nested and quantized tensors (which the meta device cannot rebuild) are refused.

The legacy (pre-zip) format carries its storages inline: there the total the pickle declares must fit the file.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from liferaft.errors import CorruptCheckpointError, InvalidStateError, PickleNotAllowedError
from liferaft.formats.zipfiles import stored_records

#: how many times its bytes the tensors that share one storage may hold together (see the module's docstring)
SHARE_LIMIT = 8
_SHARE_SLACK = 16 << 20


def tensors_in(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor in the nesting of dicts, lists and tuples ``obj`` (keys as liferaft
    names them: ``model.layer.0.weight``); other objects are not entered."""
    stack: list[tuple[str, Any, int]] = [(path, obj, 0)]
    while stack:
        key, o, depth = stack.pop()
        if isinstance(o, torch.Tensor):
            yield key or "state", o
        elif depth < 1000 and isinstance(o, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v, depth + 1) for k, v in o.items())
        elif depth < 1000 and isinstance(o, (list, tuple)):
            stack.extend((f"{key}.{i}" if key else str(i), v, depth + 1) for i, v in enumerate(o))


def _records(z: zipfile.ZipFile, f: Any) -> tuple[str, dict[str, tuple[int, int]]]:
    """(the archive's record prefix, {record name: (where its bytes start in ``f``, how many)}: every record stored
    uncompressed, whole inside the file and apart from the others, ``zipfiles.stored_records``)."""
    records = stored_records(z, f)
    if not records:
        raise ValueError("no records")
    first = next(iter(records))                 # torch's reader takes the first record's folder as the archive's
    prefix = first[:first.index("/") + 1] if "/" in first else ""
    if not prefix or any(not n.startswith(prefix) for n in records):
        raise ValueError(f"its records are not all in one folder (the first is {first[:80]!r})")
    if prefix + "data.pkl" not in records:
        raise ValueError(f"no {prefix}data.pkl record")
    return prefix, records


def _as_torch_reads(f: Any, prefix: str, records: dict[str, tuple[int, int]]) -> None:
    """ValueError unless torch's own zip reader (which ``torch.load`` uses) sees in ``f`` exactly ``records``: the
    same names (less ``prefix``), each at the same offset with the same size. Two parsers of one archive can
    disagree (a second central directory, a decoy record): the checks here must be of what torch will read."""
    f.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(f)
        names = reader.get_all_records()
        theirs = {n: (reader.get_record_offset(n), reader.get_record_size(n)) for n in names}
    except RuntimeError as e:
        raise ValueError(f"torch's zip reader refuses it ({(str(e).splitlines() or [''])[0][:120]})") from None
    ours = {n[len(prefix):]: at for n, at in records.items()}
    if theirs != ours:
        odd = sorted(set(theirs) ^ set(ours)) or sorted(n for n in ours if theirs[n] != ours[n])
        raise ValueError(f"torch's zip reader sees other records than its directory lists ({odd[:3]!r:.200}): two "
                         "readings of one archive")


def check_views(tensors: Iterator[tuple[str, torch.Tensor]], storage_of: dict[int, tuple[str, int]],
                what: str) -> None:
    """Every tensor (rebuilt on meta storages) inside its storage, and what the file's tensors materialize within
    its budget; ``storage_of`` maps a storage's ``_cdata`` to (its name in messages, its bytes).

    - inside: the bytes a view touches, its extent ``(offset + Σ (size − 1) × stride + 1) × itemsize`` (0 for an
      empty tensor), at most its storage's bytes — a broadcast buffer (``zeros(1).expand(10)``) is one element of
      its storage and reads, a view past its storage's end does not;
    - budget: the bytes the tensors hold once copied (``numel × itemsize``, summed over every tensor of the file)
      at most ``SHARE_LIMIT`` times the bytes of the storages they view plus ``_SHARE_SLACK`` (16 MiB): broadcast
      buffers, tied weights and fused-then-split views pass; an expansion bomb (``ones(1).expand(2**40)``, 4 TiB
      from a 1.5 KB file) and one storage named under a hundred thousand keys are refused before any allocation.
    """
    total = 0
    viewed: dict[int, int] = {}
    for key, t in tensors:
        if t.layout != torch.strided or t.is_nested or t.is_quantized:
            continue                                    # refused by name after the load (state.flatten)
        st = t.untyped_storage()
        if st._cdata not in storage_of:
            continue                                    # no data of the file's (a meta-device tensor)
        name, nbytes = storage_of[st._cdata]
        extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        need = extent * t.element_size() if t.numel() else 0
        if need > nbytes or min(t.stride(), default=0) < 0:
            raise CorruptCheckpointError(
                f"{what}: tensor {key!r} ({t.dtype} {list(t.shape)[:8]}, offset {t.storage_offset()}, strides "
                f"{list(t.stride())[:8]}) needs {need} bytes of storage {name}, which holds {nbytes}: a view past "
                "its storage's end; a damaged or crafted file")
        viewed[st._cdata] = nbytes
        total += t.numel() * t.element_size()
        budget = SHARE_LIMIT * sum(viewed.values()) + _SHARE_SLACK
        if total > budget:
            raise CorruptCheckpointError(
                f"{what}: tensor {key!r} ({t.dtype} {list(t.shape)[:8]} over storage {name}) brings what the "
                f"file's tensors hold once copied to {total} bytes, more than {SHARE_LIMIT} times the "
                f"{sum(viewed.values())} bytes of the storages they view (+16 MiB): an expanded view or one storage "
                "under many keys; a crafted file (reading it would allocate without bound): save .contiguous() of "
                "it")


def _kinds_refused(what: str, e: Exception) -> InvalidStateError:
    return InvalidStateError(f"{what}: holds a quantized or nested tensor ({(str(e).splitlines() or [''])[0][:120]}"
                             "); liferaft reads dense tensors only: save .dequantize() / .unbind() of it")


def _refused_pickle(what: str, e: Exception) -> PickleNotAllowedError:
    lines = str(e).splitlines()
    why = next((x.strip() for x in lines if "WeightsUnpickler error" in x), (lines or [""])[0])
    return PickleNotAllowedError(f"{what}: weights_only loading refuses it ({why.split('. Please')[0][:200]}); "
                                 "liferaft never runs code from a checkpoint: load it with "
                                 "torch.load(weights_only=False) if you trust its author")


def scan(f: Any, what: str) -> tuple[Any, dict[int, int]]:
    """Check the ``torch.save`` zip archive open as ``f`` (seekable, at its start) as the module's docstring says,
    reading only its directory and its pickle. Returns (the archive's object with its tensors on the meta device,
    {a storage's ``_cdata``: where its record's bytes start in ``f``}: the record torch reads it from, not an
    offset the pickle or a calculation claims). PickleNotAllowedError for a pickle weights_only loading refuses,
    InvalidStateError for a nested or quantized tensor, CorruptCheckpointError for anything else wrong (``what``
    names the file in messages)."""
    from torch import _weights_only_unpickler as wou

    try:
        with zipfile.ZipFile(f) as z:
            prefix, records = _records(z, f)
            if records[prefix + "data.pkl"][1] > 256 << 20:
                raise ValueError("its data.pkl record is oversized")
            pkl = z.read(prefix + "data.pkl")
        _as_torch_reads(f, prefix, records)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError, struct.error) as e:
        raise CorruptCheckpointError(f"{what}: not a readable torch.save archive ({str(e)[:200]}); damaged, "
                                     "truncated or crafted") from e
    storages: dict[str, Any] = {}
    storage_of: dict[int, tuple[str, int]] = {}
    at: dict[int, int] = {}

    def persistent_load(pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] not in ("storage", b"storage"):
            raise ValueError(f"a persistent id {str(pid)[:60]} that torch.save never writes")
        storage_type, key, _, numel = pid[1:5]
        key = key.decode() if isinstance(key, bytes) else str(key)
        if type(numel) is not int or not 0 <= numel < 1 << 62:
            raise ValueError(f"storage {key!r} declares {str(numel)[:40]} elements")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key not in storages:
            nbytes = numel * torch._utils._element_size(dtype)
            record = f"{prefix}data/{key}"
            if record not in records:
                raise CorruptCheckpointError(f"{what}: storage {key!r} has no record {record!r} in the archive; "
                                             "damaged or crafted")
            if nbytes > records[record][1]:
                raise CorruptCheckpointError(f"{what}: storage {key!r} declares {nbytes} bytes, its record holds "
                                             f"{records[record][1]}; truncated or crafted (it would read past its "
                                             "record)")
            untyped = torch.UntypedStorage(nbytes, device="meta")
            storage_of[untyped._cdata] = (repr(key), nbytes)
            at[untyped._cdata] = records[record][0]
            storages[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return storages[key]
    try:
        up = wou.Unpickler(io.BytesIO(pkl), encoding="utf-8")
        up.persistent_load = persistent_load            # the hook torch.load itself sets on this unpickler
        obj = up.load()
    except (CorruptCheckpointError, PickleNotAllowedError):
        raise
    except pickle.UnpicklingError as e:
        raise _refused_pickle(what, e) from e
    except NotImplementedError as e:
        raise _kinds_refused(what, e) from e
    except Exception as e:  # nothing ran (weights_only) and nothing was read: any failure is damage
        raise CorruptCheckpointError(f"{what}: its pickle does not rebuild ({type(e).__name__}: "
                                     f"{(str(e).splitlines() or [''])[0][:200]}); damaged or crafted") from e
    check_views(tensors_in(obj), storage_of, what)
    f.seek(0)
    return obj, at


def scan_legacy(path: Any, what: str) -> None:
    """The legacy (pre-zip) format (``path``: its name, or the file open at its start): loaded to the meta device
    (nothing allocated), the storages it declares together no larger than the file that must hold them, every
    tensor inside its storage."""
    try:
        size = os.fstat(path.fileno()).st_size if hasattr(path, "fileno") else os.path.getsize(path)
        obj = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused_pickle(what, e) from e
    except NotImplementedError as e:
        raise _kinds_refused(what, e) from e
    except Exception as e:  # as in scan
        raise CorruptCheckpointError(f"{what}: not a readable torch.save file ({type(e).__name__}: "
                                     f"{(str(e).splitlines() or [''])[0][:200]})") from e
    found = list(tensors_in(obj))
    storage_of = {t.untyped_storage()._cdata: (f"of {k!r}", t.untyped_storage().nbytes()) for k, t in found
                  if t.layout == torch.strided and not t.is_nested and not t.is_quantized}
    total = sum(n for _, n in storage_of.values())
    if total > size:
        raise CorruptCheckpointError(f"{what}: its storages declare {total} bytes, the file has {size}; "
                                     "truncated or crafted")
    check_views(iter(found), storage_of, what)
