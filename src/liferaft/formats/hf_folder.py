"""The Hugging Face side of an export: which subtree of a liferaft checkpoint is the model, which files of an HF
folder are weights (never copied along) and which are its config and tokenizer (recorded at import, written
beside an export), all bounded and kept inside the folder they belong to."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO

from liferaft.errors import CorruptCheckpointError, OptionsError, StateMismatchError
from liferaft.format import jsonsafe
from liferaft.storage import files

#: Files of a Hugging Face folder that hold weights (never copied with a config; the export writes its own).
WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|gguf|ot|tflite|npz)$|"
                     r".*\.(safetensors|bin)\.index\.json$")
#: An import records a source folder's other files (config, tokenizer, ...) in the manifest when they take at most
#: this much in all, else only its ``config.json`` and ``generation_config.json``.
RECORD_LIMIT = 2 << 20


def model_subtree(m: Any, module: str | None = None) -> tuple[str, str]:
    """(key of the subtree of manifest ``m`` that is the model's state dict — "" for the whole checkpoint —, its
    class or how it was chosen). ``module`` names it; otherwise the one container recorded as an ``nn.Module``;
    in checkpoints written before that was recorded, the one stateful object that holds only tensors and is not
    an optimizer; in checkpoints of plain dicts (imports from DCP, ``torch.save``), a top-level ``model``, or the
    whole checkpoint when it holds only tensors and nothing that looks like optimizer state. Several candidates,
    or none: OptionsError asking for ``module``."""
    keys = [e.key for e in m.tensors if e.kind == "tensor"]
    stateful = [c for c in m.containers if c.kind == "stateful"]

    def name(c: Any) -> str:
        return ".".join(str(p) for p in c.path)
    if module is not None:
        if module == "":
            return "", "the whole checkpoint"
        if not any(k.startswith(module + ".") for k in keys):
            tops = sorted({".".join(str(p) for p in c.path) for c in m.containers if len(c.path) == 1})
            raise OptionsError(f"--module {module!r}: no tensor of the checkpoint lies under {module!r}; "
                               f"subtrees at the top: {tops}")
        c = next((c for c in stateful if name(c) == module), None)
        return module, (c.cls or "").rsplit(".", 1)[-1] if c is not None else "chosen"
    modules = [c for c in stateful if c.role == "module"]
    if not modules and not any(c.role for c in stateful):     # written before roles were recorded
        values = {v.key for v in m.values}
        modules = [c for c in stateful if not {"state", "param_groups"} <= set(c.children or ())
                   and not any(v == name(c) or v.startswith(name(c) + ".") for v in values)
                   and any(k.startswith(name(c) + ".") for k in keys)]
    if len(modules) == 1:
        return name(modules[0]), (modules[0].cls or "nn.Module").rsplit(".", 1)[-1]
    if len(modules) > 1:
        raise OptionsError(f"this checkpoint holds {len(modules)} modules ({', '.join(repr(name(c)) for c in modules)})"
                           ": say which to export with --module NAME (Python: module=NAME)")
    if not stateful:
        if any(k.startswith("model.") for k in keys):
            return "model", "the 'model' subtree"
        optimizer_like = any(".exp_avg" in k or k.startswith(("optim", "optimizer")) for k in keys)
        if keys and not m.values and not optimizer_like:
            return "", "the whole checkpoint"
    tops = sorted({str(k.split(".", 1)[0]) for k in keys})
    raise OptionsError(f"cannot tell which part of this checkpoint is the model (no subtree was saved as an "
                       f"nn.Module): pass --module KEY, one of {tops[:10]}, or --module '' for all of its tensors")


# --------------------------------------------------------------------------- the files of a folder, read safely

#: Any one file of a Hugging Face folder that is read or copied whole (config, tokenizer, ...): at most this.
FILE_LIMIT = 1 << 30
#: A ``config.json`` or ``model.safetensors.index.json`` is read into memory: at most this.
JSON_LIMIT = 64 << 20
#: At most this many files in the listing of an HF folder (``--config /`` would walk the disk).
MAX_FILES = 10_000
#: The index of a sharded safetensors folder.
INDEX = "model.safetensors.index.json"


def roots(folder: str) -> tuple[str, ...]:
    """Where the files of ``folder`` may lie: the folder itself (resolved: links above it are the user's), and
    for a snapshot of the Hugging Face hub cache (``models--org--name/snapshots/REV``, whose files are links to
    ``../../blobs/``) that repository's ``blobs`` folder, the one place a link may lead."""
    real = os.path.realpath(folder)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        return real, os.path.join(os.path.dirname(parent), "blobs")
    return (real,)


def _within(real: str, where: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in where)


def check_file(path: str, name: str, where: tuple[str, ...] | None, error: type[Exception] = OptionsError,
               what: str = "file") -> int:
    """The size of ``path`` (``name`` in messages), which must be a regular file (a FIFO or a device would hang
    a reader or never end). Unless ``where`` is None (a file the user named: its links are the user's), it
    must be a plain file of the folder ``where[0]`` (``roots``), not a link — except a hub-cache snapshot's
    link into that repository's blobs (``where[1]``); ``error`` naming it otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        link = " (a link to nowhere)" if os.path.islink(path) else ""
        raise error(f"{what} {name!r} is missing{link}") from e
    except OSError as e:
        raise error(f"{what} {name!r} cannot be read ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {name!r} is {files.kind(st.st_mode)}, not a regular file: liferaft reads only regular "
                    "files (remove it, or put the file itself there)")
    if where is not None:
        real = os.path.realpath(path)
        plain = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if not _within(real, where[:1] if real == plain else where[1:]):
            where_to = "" if _within(real, where[:1]) else ", outside its folder"
            raise error(f"{what} {name!r} is a link to {real}{where_to}: liferaft follows no link in a folder it "
                        "reads (but a hub-cache snapshot's links to its blobs), so nothing outside it is read; copy "
                        "the file in")
    return st.st_size


def open_regular(path: str, name: str, error: type[Exception] = OptionsError, limit: int | None = None,
                 what: str = "file") -> BinaryIO:
    """``path`` open for reading, checked after opening (nothing can swap it in between): a regular file (opened
    without blocking, so a FIFO cannot hang the open) of at most ``limit`` bytes (``storage.files.open_path``);
    ``error`` naming it otherwise."""
    try:
        fd = files.open_path(path, limit=limit, error=error, shown=f"{what} {name!r}")
    except OSError as e:
        raise error(f"{what} {name!r} cannot be opened ({e.strerror})") from e
    return os.fdopen(fd, "rb")


def read_capped(path: str, name: str, error: type[Exception] = OptionsError, limit: int = JSON_LIMIT,
                what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (``open_regular``)."""
    with open_regular(path, name, error, limit, what) as f:
        return files.read_fd(f.fileno(), f"{what} {name!r}", limit, error)


plain_name = files.plain_component


def check_name(rel: Any, error: type[Exception], what: str) -> list[str]:
    """The components of ``rel``, the name of a file relative to an HF folder (``/``-separated), which must be a
    plain relative path: non-empty components without ``\\`` or NUL, no ``.``/``..``, not absolute; ``error``
    otherwise."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or not all(plain_name(p) for p in parts):
        raise error(f"{what} {rel!r} is not a plain relative file name (no leading '/', no empty, '.' or '..' "
                    "component, no backslash or NUL)")
    return parts


def index_map(src: str) -> dict[str, str] | None:
    """The ``weight_map`` of a folder's ``model.safetensors.index.json`` (tensor name → file name), None for a file
    or a folder without an index; CorruptCheckpointError for an index that is not one (capped read, regular file
    inside the folder)."""
    index = os.path.join(src, INDEX)
    if not os.path.isdir(src) or not os.path.lexists(index):
        return None
    check_file(index, f"{src}/{INDEX}", roots(src), CorruptCheckpointError)
    raw = read_capped(index, f"{src}/{INDEX}", CorruptCheckpointError)
    doc = jsonsafe.loads(raw, f"file {src}/{INDEX}", len(raw),     # (read_capped capped it) strict: depth, no NaN
                         advice="not a safetensors index; the folder is damaged or crafted")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"file {src}/{INDEX} is not a safetensors index (a JSON object whose "
                                     "\"weight_map\" maps each tensor name to its file)")
    return weight_map


def st_files(src: str) -> list[str]:
    """The safetensors files of ``src``: the file itself, or a folder's ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names. Each must be a regular file (a FIFO or device would hang the
    reader); an index must be a JSON object whose ``weight_map`` maps tensor names to plain file names of that
    folder, and each shard must lie in it once links are resolved (``roots``: the hub cache's blobs too);
    CorruptCheckpointError naming the file (and key) otherwise."""
    if not os.path.isdir(src):
        check_file(src, src, None, CorruptCheckpointError, "safetensors file")
        return [src]
    where = roots(src)
    weight_map = index_map(src)
    if weight_map is not None:
        files: dict[str, str] = {}
        for key, name in weight_map.items():
            if not plain_name(name) or not name.endswith(".safetensors"):
                raise CorruptCheckpointError(f"file {src}/{INDEX}: tensor {key!r} is said to lie in {name!r}, not "
                                             "the name of a .safetensors file in that folder; the index is damaged "
                                             "or crafted")
            files.setdefault(name, key)
        for name, key in files.items():
            check_file(os.path.join(src, name), f"{src}/{name}", where, CorruptCheckpointError,
                       f"shard (of tensor {key!r})")
        return [os.path.join(src, n) for n in files]
    single = os.path.join(src, "model.safetensors")
    if os.path.lexists(single):
        check_file(single, f"{src}/model.safetensors", where, CorruptCheckpointError)
        return [single]
    raise StateMismatchError(f"{src}: no model.safetensors or {INDEX} there")


# --------------------------------------------------------------------------- config and tokenizer files


def hf_files(folder: str, error: type[Exception] = OptionsError) -> dict[str, str]:
    """The files of a Hugging Face folder an export brings along (relative path → absolute path): everything
    but weight files and hidden files, subfolders included (a sentence-transformers ``1_Pooling/config.json``).
    Each must be a regular file inside the folder (``check_file``), at most ``MAX_FILES`` of them; ``error``
    naming the file otherwise."""
    where = roots(folder)
    out = {}
    seen = 0
    for d, dirs, fs in files.walk(folder):
        seen += len(dirs) + len(fs)            # (every entry walked counts: a big tree of hidden files too)
        if seen > 8 * MAX_FILES:
            raise error(f"{folder}: more than {8 * MAX_FILES} files and folders; not a model folder")
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in sorted(fs):
            if f.startswith(".") or WEIGHTS.fullmatch(f):
                continue
            full = os.path.join(d, f)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            check_name(rel, error, f"{folder}: file")
            check_file(full, f"{folder}/{rel}", where, error)
            out[rel] = full
            if len(out) > MAX_FILES:
                raise error(f"{folder}: more than {MAX_FILES} files besides weights; not a model folder")
    return out


def recorded_files(folder: str) -> dict[str, str]:
    """What an import of ``folder`` records in the manifest (``extra["hf"]["files"]``, text by relative path): the
    files ``hf_files`` lists when they are UTF-8 text of at most ``RECORD_LIMIT`` in all, else the configs. A FIFO,
    device or link out of the folder among them: CorruptCheckpointError naming it."""
    files = hf_files(folder, CorruptCheckpointError)
    sizes = {rel: os.path.getsize(full) for rel, full in files.items()}
    if sum(sizes.values()) > RECORD_LIMIT:
        files = {k: v for k, v in files.items() if k in ("config.json", "generation_config.json")}
    out = {}
    for rel, full in files.items():
        if sizes[rel] > RECORD_LIMIT:
            continue
        try:
            out[rel] = read_capped(full, f"{folder}/{rel}", CorruptCheckpointError, RECORD_LIMIT).decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def _with_dtype(text: str, dtype: str | None) -> str:
    """``config.json`` with its ``dtype``/``torch_dtype`` set to the export's dtype (when it names one)."""
    if not dtype:
        return text
    try:
        raw = text.encode("utf-8")
        doc = jsonsafe.loads(raw, "config.json", len(raw))     # strict: depth limit, no NaN/Infinity
    except (CorruptCheckpointError, UnicodeEncodeError):
        return text
    if not isinstance(doc, dict) or not ({"dtype", "torch_dtype"} & set(doc)):
        return text
    for k in ("dtype", "torch_dtype"):
        if k in doc:
            doc[k] = dtype
    return json.dumps(doc, indent=2) + "\n"


@dataclass(frozen=True)
class _Copy:
    """A file to copy into the export (from a ``--config`` folder), streamed when written."""

    path: str
    name: str


def plan_config(config: str | os.PathLike[str] | None, recorded: Any, dtype: str | None
                ) -> tuple[dict[str, bytes | _Copy], str]:
    """The config (and tokenizer, ...) files of an HF export, every name and file checked before anything is
    written: (relative name → contents or a file to copy, a note). From ``config`` (a ``config.json``, or a
    folder: ``hf_files``; OptionsError for what is wrong there), else those an import recorded (``recorded``,
    from the manifest: CorruptCheckpointError for a name that is not a plain relative path, names a weight file
    or the index an export writes, or is both a file and a folder)."""
    contents: dict[str, bytes | _Copy] = {}
    if config is not None:
        c = os.fspath(config)
        if os.path.isdir(c):
            if not os.path.isfile(os.path.join(c, "config.json")):     # (before walking the folder)
                raise OptionsError(f"--config {c}: no config.json in that folder; not a Hugging Face model folder")
            files = hf_files(c, OptionsError)
            for rel, full in files.items():
                if check_file(full, f"{c}/{rel}", None, OptionsError) > FILE_LIMIT:
                    raise OptionsError(f"--config {c}: file {rel!r} holds more than {FILE_LIMIT} bytes; not a "
                                       "config or tokenizer file")
                contents[rel] = _Copy(full, f"{c}/{rel}")
            if "config.json" not in contents:
                raise OptionsError(f"--config {c}: no config.json in that folder")
            contents["config.json"] = read_capped(files["config.json"], f"{c}/config.json", OptionsError)
            note = f"config: {len(contents)} file(s) from {c}"
        elif os.path.lexists(c):
            check_file(c, c, None, OptionsError, "--config")
            contents["config.json"] = read_capped(c, c, OptionsError, what="--config")
            note = f"config: {c}"
        else:
            raise OptionsError(f"--config {c}: no such file or folder")
        raw = contents["config.json"]
        try:                                    # strict: a depth limit, no NaN/Infinity, no repeated key
            doc = jsonsafe.loads(raw, f"--config {c}: config.json", len(raw),  # type: ignore[arg-type]
                                 advice="pass the model's config.json")
        except CorruptCheckpointError as e:
            raise OptionsError(f"{e} (its config.json is not a JSON config)") from e
        if not isinstance(doc, dict):
            raise OptionsError(f"--config {c}: its config.json is not a JSON config (not a JSON object)")
        bad: type[Exception] = OptionsError
    elif recorded:
        if not isinstance(recorded, dict) or not all(isinstance(t, str) for t in recorded.values()):
            raise CorruptCheckpointError("the checkpoint's metadata \"hf\" → \"files\" is not a map of file names to "
                                         "text; the manifest is damaged")
        contents = {rel: text.encode("utf-8", "surrogatepass") for rel, text in recorded.items()}
        note = f"config: {len(contents)} file(s) recorded when the checkpoint was imported from a Hugging Face folder"
        bad = CorruptCheckpointError
    else:
        return {}, ("no config.json: from_pretrained needs one; pass --config (a config.json, or the model's "
                    "folder to bring its tokenizer files too)")
    what = "config file" if bad is OptionsError else "Hugging Face file (recorded in the manifest)"
    for rel in contents:
        parts = check_name(rel, bad, what)
        if WEIGHTS.fullmatch(rel) or any(WEIGHTS.fullmatch(p) or p == INDEX for p in parts):
            raise bad(f"{what} {rel!r}: a weight file's name, or a name below one (the export writes its own "
                      "weights and index there)")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in contents:
                raise bad(f"{what} {rel!r} lies below {'/'.join(parts[:i])!r}, which is a file as well")
    if dtype and isinstance(contents.get("config.json"), bytes):
        try:
            contents["config.json"] = _with_dtype(contents["config.json"].decode("utf-8"),  # type: ignore
                                                  dtype).encode("utf-8")
        except UnicodeDecodeError:
            pass
    return contents, note


def _folder_at(parent: int, name: str, rel: str, dst: str) -> int:
    """The folder ``name`` of the open folder ``parent`` (made if absent), opened; never through a link."""
    try:
        os.mkdir(name, 0o777, dir_fd=parent)
    except FileExistsError:
        pass
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                       dir_fd=parent)
    except OSError as e:
        raise OptionsError(f"{dst}: cannot write {rel!r}: {name!r} there is a link or not a folder ({e.strerror}); "
                           "liferaft writes nothing through links") from e


def write_config(contents: dict[str, bytes | _Copy], dst: str) -> list[str]:
    """Write the files ``plan_config`` planned into the folder ``dst`` (followed once if it is itself a link, as
    any output folder is). Inside it nothing is written through a link: each folder on the way is opened without
    following links, and whatever lies at a file's name (an earlier export's file, a link, a FIFO) is removed and
    the file created anew. OSError: OptionsError naming the file."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
    root = os.open(os.path.realpath(dst), flags)
    try:
        for rel, what in contents.items():
            parts = rel.split("/")
            opened: list[int] = []
            try:
                at = root
                for name in parts[:-1]:
                    at = _folder_at(at, name, rel, dst)
                    opened.append(at)
                try:
                    if stat.S_ISDIR(os.stat(parts[-1], dir_fd=at, follow_symlinks=False).st_mode):
                        raise OptionsError(f"{dst}: cannot write {rel!r}: a folder of that name is there")
                    os.unlink(parts[-1], dir_fd=at)
                except FileNotFoundError:
                    pass
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             getattr(os, "O_CLOEXEC", 0), 0o644, dir_fd=at)
                with os.fdopen(fd, "wb") as out:
                    if isinstance(what, bytes):
                        out.write(what)
                    else:
                        with open_regular(what.path, what.name, OptionsError, FILE_LIMIT) as f:
                            while piece := f.read(8 << 20):
                                out.write(piece)
            except OSError as e:
                raise OptionsError(f"{dst}: cannot write {rel!r} ({e.strerror or e})") from e
            finally:
                for fd in opened:
                    os.close(fd)
    finally:
        os.close(root)
    return list(contents)


def bring_config(config: str | os.PathLike[str] | None, recorded: dict[str, str] | None, dst: str,
                 dtype: str | None) -> tuple[list[str], str]:
    """Write the config (and tokenizer, ...) files of an HF export into ``dst``: from ``config`` (a
    ``config.json``, or a folder: ``hf_files``), else those an import recorded. Returns (files, a note).
    (``to_hf`` plans them before it writes the weights, and writes them after: ``plan_config``, ``write_config``.)"""
    contents, note = plan_config(config, recorded, dtype)
    os.makedirs(dst, exist_ok=True)
    return write_config(contents, dst), note
