"""The Hugging Face side of an export: which subtree of a liferaft checkpoint is the model, which files of an HF
folder are weights (never copied along) and which are its config and tokenizer (recorded at import, written
beside an export), all bounded and kept inside the folder they belong to."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from liferaft.errors import OptionsError

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


def hf_files(folder: str) -> dict[str, str]:
    """The files of a Hugging Face folder an export brings along (relative path → absolute path): everything
    but weight files and hidden files, subfolders included (a sentence-transformers ``1_Pooling/config.json``)."""
    out = {}
    for d, dirs, fs in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in sorted(fs):
            if f.startswith(".") or WEIGHTS.fullmatch(f):
                continue
            full = os.path.join(d, f)
            out[os.path.relpath(full, folder).replace(os.sep, "/")] = full
    return out


def recorded_files(folder: str) -> dict[str, str]:
    """What an import of ``folder`` records in the manifest (``extra["hf"]["files"]``, text by relative path): the
    files ``hf_files`` lists when they are UTF-8 text of at most ``RECORD_LIMIT`` in all, else the configs."""
    files = hf_files(folder)
    if sum(os.path.getsize(p) for p in files.values()) > RECORD_LIMIT:
        files = {k: v for k, v in files.items() if k in ("config.json", "generation_config.json")}
    out = {}
    for rel, full in files.items():
        try:
            with open(full, encoding="utf-8") as f:
                out[rel] = f.read()
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _with_dtype(text: str, dtype: str | None) -> str:
    """``config.json`` with its ``dtype``/``torch_dtype`` set to the export's dtype (when it names one)."""
    if not dtype:
        return text
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    if not isinstance(doc, dict) or not ({"dtype", "torch_dtype"} & set(doc)):
        return text
    for k in ("dtype", "torch_dtype"):
        if k in doc:
            doc[k] = dtype
    return json.dumps(doc, indent=2) + "\n"


def bring_config(config: str | os.PathLike[str] | None, recorded: dict[str, str] | None, dst: str,
                  dtype: str | None) -> tuple[list[str], str]:
    """Write the config (and tokenizer, ...) files of an HF export into ``dst``: from ``config`` (a
    ``config.json``, or a folder: ``hf_files``), else those an import recorded. Returns (files, a note)."""
    contents: dict[str, bytes] = {}
    if config is not None:
        c = os.fspath(config)
        if os.path.isdir(c):
            for rel, full in hf_files(c).items():
                with open(full, "rb") as f:
                    contents[rel] = f.read()
            if "config.json" not in contents:
                raise OptionsError(f"--config {c}: no config.json in that folder")
            note = f"config: {len(contents)} file(s) from {c}"
        elif os.path.isfile(c):
            with open(c, "rb") as f:
                contents["config.json"] = f.read()
            note = f"config: {c}"
        else:
            raise OptionsError(f"--config {c}: no such file or folder")
        try:
            if not isinstance(json.loads(contents["config.json"]), dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise OptionsError(f"--config {c}: its config.json is not a JSON config ({e})") from e
    elif recorded:
        contents = {rel: text.encode("utf-8") for rel, text in recorded.items() if isinstance(text, str)}
        note = f"config: {len(contents)} file(s) recorded when the checkpoint was imported from a Hugging Face folder"
    else:
        return [], ("no config.json: from_pretrained needs one; pass --config (a config.json, or the model's "
                    "folder to bring its tokenizer files too)")
    for rel, raw in contents.items():
        if rel.startswith("/") or ".." in rel.split("/"):
            raise OptionsError(f"config file {rel!r} would lie outside {dst}")
        target = os.path.join(dst, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if rel == "config.json":
            raw = _with_dtype(raw.decode("utf-8"), dtype).encode("utf-8")
        with open(target, "wb") as f:
            f.write(raw)
    return list(contents), note
