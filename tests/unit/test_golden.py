"""The committed golden checkpoint of format version 1 (tests/golden/v1) stays readable and loadable.

It is compared with the values recomputed by the generator that wrote it (tests/golden/make_golden.py). This
test only reads the golden directory and checks that reading changes no byte of it; it never regenerates it.
"""

from __future__ import annotations

import math

import pytest
import torch
import xxhash
from compare import assert_same as _assert_same
from golden.make_golden import GOLDEN_DIR, SHARDED_SHAPE, WORLD, expected_state

import liferaft
from liferaft import PerRank, Sharded

PATH = str(GOLDEN_DIR)


def assert_same(a, b, where="state"):
    _assert_same(a, b, where, ordered=False)   # the golden pins values, not key order


def golden_digest() -> dict[str, str]:
    return {str(p.relative_to(GOLDEN_DIR)): xxhash.xxh3_64_hexdigest(p.read_bytes())
            for p in sorted(GOLDEN_DIR.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def golden_untouched():
    assert (GOLDEN_DIR / "COMMIT").is_file(), f"the golden checkpoint {GOLDEN_DIR} is missing; restore it from git"
    before = golden_digest()
    yield
    assert golden_digest() == before, "reading the golden checkpoint changed its files"


def blank(v):
    """A load template shaped like ``v``: zero tensors, fresh objects, None for every plain value."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [blank(x) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return tuple(blank(x) for x in v)
    return None


def load_template() -> dict:
    t = blank(expected_state())
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    t["model"] = lin
    return t


def test_inspect_golden():
    info = liferaft.inspect(PATH)
    assert info.format_version == 1
    assert info.world_size == WORLD
    assert dict(info.metadata) == {"golden": "v1"}
    tensors = {t.key: (t.kind, t.dtype, t.shape, t.chunks) for t in info.tensors}
    assert tensors["sharded"] == ("tensor", "float32", SHARDED_SHAPE, 2)
    assert tensors["tensors.scalar"] == ("tensor", "float32", (), 1)
    assert tensors["tensors.bf16"] == ("tensor", "bfloat16", (5,), 1)
    assert tensors["tensors.empty"][:3] == ("tensor", "float32", (0, 3))
    assert tensors["large_np"] == ("numpy", "float32", (20000,), 1)
    assert tensors["large_bytes"] == ("bytes", "uint8", (76800,), 1)
    assert {"model.weight", "model.bias", "nested.list.0", "nested.list.1.t", "nested.tuple.0"} <= set(tensors)
    assert {"values.nan", "values.set", "values.np_small", "config", "rank", "nested.list.2"} <= set(info.values)
    assert len(info.files) == WORLD


def test_verify_golden():
    report = liferaft.verify(PATH)
    assert report.chunks == sum(t.chunks for t in liferaft.inspect(PATH).tensors)
    assert report.bytes_checked > 150_000


def test_read_golden():
    expected = dict(expected_state(), rank=PerRank((0, 1)))
    got = liferaft.read(PATH)
    assert set(got) == set(expected)
    for k in expected:
        assert_same(got[k], expected[k], k)


def test_read_golden_selected_keys():
    got = liferaft.read(PATH, ["tensors", "values.nan", "nested.tuple"])
    exp = expected_state()
    assert_same(got, {"tensors": exp["tensors"], "values": {"nan": math.nan},
                      "nested": {"tuple": exp["nested"]["tuple"]}})


def test_load_golden():
    t = load_template()
    res = liferaft.load(PATH, t, strict=False)
    # a value that differed per saving rank cannot be mapped onto one process; everything else loads
    assert res.missing_keys == ()
    assert res.unexpected_keys == ("rank",)
    exp = expected_state()
    assert_same({k: v.detach() for k, v in t.pop("model").state_dict().items()}, exp.pop("model"), "model")
    assert set(t) == set(exp)
    for k in exp:
        assert_same(t[k], exp[k], k)


@pytest.mark.parametrize("offset,rows", [(0, 4), (1, 2), (3, 1)])
def test_load_golden_sharded_tensor_into_another_layout(offset, rows):
    t = {"sharded": Sharded(torch.zeros(rows, SHARDED_SHAPE[1]), SHARDED_SHAPE, (offset, 0))}
    res = liferaft.load(PATH, t, strict=False)
    assert res.missing_keys == ()
    assert_same(t["sharded"].local, expected_state()["sharded"][offset:offset + rows])
