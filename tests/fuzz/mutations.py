"""Hypothesis strategies that damage inputs: JSON trees (replace a node by a hostile value, drop it, wrap it,
duplicate it, nest it thousands deep) and bytes (overwrite, insert, delete, truncate; anywhere or in a focus
range). ``$SECRET`` in a drawn string stands for a file outside the checkpoint (``with_secret``)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

DEEP = "__liferaft_fuzz_deep__"

PATHS = ["../x", "../../secret/secret.bin", "$SECRET", "/etc/passwd", "/dev/zero", "../step-0000000001/COMMIT",
         "../step-0000000001/data", "data", "", ".", "..", "data/../../../secret/secret.bin", "COMMIT", "a\x00b",
         "data//r00000.bin", "~/x", "\\..\\x"]
NUMBERS = [0, -1, 1, 2, 3, 7, 255, 256, 4096, 65535, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64,
           -(2**63), 10**30, 10**400, 0.5, -0.0, 1e300, -1e300, float("nan"), float("inf"), float("-inf"), True,
           False]
OTHERS = [None, "", "x" * 5000, "float32", "int64", "bool", "complex128", "q8-block", "bytegroup-zstd", "zstd",
          "stateful", "list", "tuple", "dict", "tensor", "$float", {"$float": "nan"}, {"$pickle": "gASVAAAA"},
          {"$tuple": [1, {"$bytes": "!!"}]}, [], {}, [[]], [0] * 40, [2**40] * 4, {"": 1}, "big", "little",
          "0123456789abcdef", "liferaft", DEEP]


def hostile() -> st.SearchStrategy[Any]:
    """A value a hostile manifest may hold where anything else was."""
    return st.one_of(st.sampled_from(NUMBERS), st.sampled_from(PATHS), st.sampled_from(OTHERS),
                     st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=12),
                     st.lists(st.integers(-3, 2**40), max_size=5))


def paths(tree: Any, at: tuple = ()) -> list[tuple]:
    """Every node of a JSON tree, by its path (the root is ``()``)."""
    out = [at]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, at + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, at + (i,))
    return out


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def mutate_tree(data: st.DataObject, tree: Any, label: str = "") -> tuple[Any, tuple, str]:
    """One structural mutation of a copy of ``tree``: (the new tree, the path changed, the operation)."""
    tree = json.loads(json.dumps(tree))
    at = data.draw(st.sampled_from(paths(tree)[1:]), label=f"{label} node")
    parent, last = _get(tree, at[:-1]), at[-1]
    op = data.draw(st.sampled_from(["replace", "replace", "replace", "drop", "wrap", "dup", "deep", "rename"]),
                   label=f"{label} op")
    if op == "replace":
        parent[last] = data.draw(hostile(), label=f"{label} value")
    elif op == "drop":
        del parent[last]
    elif op == "wrap":
        parent[last] = data.draw(st.sampled_from([[parent[last]], {"x": parent[last]}, str(parent[last])]))
    elif op == "dup" and isinstance(parent, list):
        parent.insert(last, json.loads(json.dumps(parent[last])))
    elif op == "dup":
        parent[f"{last}"] = parent[last]
        parent[f"{last} "] = parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[data.draw(st.sampled_from(["", "x", "key", "file", "$pickle"]))] = parent.pop(last)
    else:
        parent[last] = DEEP
    return tree, at, op


def dumps(tree: Any, data: st.DataObject) -> bytes:
    """JSON text of a mutated tree, NaN/Infinity as Python writes them, ``DEEP`` nested arrays/objects."""
    text = json.dumps(tree, allow_nan=True)
    if DEEP in text:
        n = data.draw(st.sampled_from([200, 1200, 5000, 100_000]), label="depth")
        deep = data.draw(st.sampled_from(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n]), label="deep kind")
        text = text.replace(json.dumps(DEEP), deep)
    return text.encode()


def mutate_bytes(data: st.DataObject, blob: bytes, focus: tuple[int, int] | None = None,
                 label: str = "") -> bytes:
    """One to four byte edits of ``blob`` (in ``focus``, a [start, end) range, when given)."""
    b = bytearray(blob)
    lo, hi = focus if focus else (0, len(b))
    for _ in range(data.draw(st.integers(1, 4), label=f"{label} edits")):
        hi = min(hi, len(b))
        if hi <= lo:
            break
        pos = data.draw(st.integers(lo, hi - 1), label=f"{label} at")
        op = data.draw(st.sampled_from(["set", "set", "flip", "insert", "delete", "truncate", "fill"]),
                       label=f"{label} op")
        if op == "set":
            b[pos] = data.draw(st.integers(0, 255))
        elif op == "flip":
            b[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[pos:pos + data.draw(st.integers(1, 64))]
        elif op == "truncate":
            del b[pos:]
        else:
            n = data.draw(st.integers(1, 16))
            b[pos:pos + n] = data.draw(st.sampled_from([b"\xff", b"\x00", b"\x7f"])) * n
    return bytes(b)


def with_secret(text: bytes, secret: str) -> bytes:
    return text.replace(b"$SECRET", secret.encode())
