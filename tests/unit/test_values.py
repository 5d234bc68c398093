import math

import numpy as np
import pytest
import torch

from liferaft.errors import CorruptCheckpointError, PickleNotAllowedError
from liferaft.state.values import decode_value, encode_value


class Thing:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Thing) and other.x == self.x


VALUES = [None, True, False, 0, -7, 2**70, 1.5, -0.0, "héllo", b"\x00\xff", [1, [2, "a"]], (1, (2.5, None)),
          {"a": 1, "b": {"c": [1, 2]}}, {1: "int key", "s": 2}, {"$x": 1}, {3, 4}, frozenset({"q"}), 1 + 2j,
          np.arange(6, dtype=np.int16).reshape(2, 3), np.float32(1.25), torch.bfloat16, torch.Size([2, 3]), []]


@pytest.mark.parametrize("v", VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(VALUES)])
def test_roundtrip_without_pickle(v):
    got = decode_value(encode_value(v, "k"), "k")
    if isinstance(v, np.ndarray):
        assert got.dtype == v.dtype and np.array_equal(got, v)
    else:
        assert got == v and type(got) is type(v)


def test_special_floats():
    got = decode_value(encode_value([math.nan, math.inf, -math.inf], "k"), "k")
    assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf


def test_pickle_needs_opt_in_both_ways():
    with pytest.raises(PickleNotAllowedError, match="key 'obj'.*Thing"):
        encode_value(Thing(1), "obj")
    enc = encode_value(Thing(1), "obj", allow_pickle=True)
    with pytest.raises(PickleNotAllowedError, match="key 'obj' holds a pickled value"):
        decode_value(enc, "obj")
    assert decode_value(enc, "obj", allow_pickle=True) == Thing(1)


def test_object_arrays_refused():
    with pytest.raises(PickleNotAllowedError):
        encode_value(np.array([Thing(1)], dtype=object), "a")


@pytest.mark.parametrize("bad", [{"$ndarray": {"dtype": "|O", "shape": [1], "data": ""}}, {"$nope": 1},
                                 {"$torch_dtype": "not_a_dtype"}, {"$bytes": 5}])
def test_malformed_values_are_corrupt(bad):
    with pytest.raises(CorruptCheckpointError, match="key 'k'"):
        decode_value(bad, "k")


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


@pytest.mark.parametrize("dtype,data", [("f4,i4", bytes(8)), ("V8", bytes(8)), ("(2,)f4", bytes(8)),
                                        ("float32", bytes(4)), ("f4", bytes(4)), ("|b1", b"\x02"),
                                        ("|b1", b"\xff")])
@pytest.mark.parametrize("tag", ["$ndarray", "$npscalar"])
def test_numpy_values_of_a_dtype_encode_value_never_writes_are_corrupt(tag, dtype, data):
    """Structured, raw-void and sub-array dtypes, a dtype not in its canonical form (``dtype.str``), a bool byte
    other than 0 or 1: refused naming the key (FORMAT.md: what ``encode_value`` writes, nothing else)."""
    body = {"dtype": dtype, "data": _b64(data), **({"shape": [1]} if tag == "$ndarray" else {})}
    with pytest.raises(CorruptCheckpointError, match="key 'k'"):
        decode_value({tag: body}, "k")


@pytest.mark.parametrize("v", [np.array([True, False]), np.array([1.5], dtype=">f4"), np.array(["ab"]),
                               np.bool_(False), np.float32(2.0)])
def test_numpy_values_of_every_plain_dtype_still_round_trip(v):
    got = decode_value(encode_value(v, "k"), "k")
    assert type(got) is type(v) and got.dtype == v.dtype and np.array_equal(got, v)


@pytest.mark.parametrize("v", [np.complex128(1 + 2j), np.complex64(-0.5 + 3j), np.float16(1.5), np.int8(-3),
                               np.bool_(True), np.uint64(2 ** 63)])
def test_numpy_scalars_round_trip_with_their_type(v):
    # numpy's complex scalars subclass complex: they were stored as $complex of numpy floats, which the reader
    # refused as damaged (found by fuzzing)
    out = decode_value(encode_value(v, "k"), "k")
    assert type(out) is type(v) and out.tobytes() == v.tobytes()


@pytest.mark.parametrize("v", [np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), np.ma.masked_array([1.0, 2.0], [0, 1]),
                               np.rec.array([(1, 2.0)], dtype=[("x", "<i4"), ("y", "<f8")]), np.matrix([[1, 2]]),
                               np.zeros(1, dtype=[("a", "<i4")])[0], np.zeros(2, dtype="V4")])
def test_numpy_values_whose_bytes_do_not_say_all_need_pickle(v):
    # a structured dtype's str is |V<n> (its field names lost), a masked array's mask is not in its bytes: they
    # were stored as plain bytes and came back different; now they need allow_pickle, like object arrays
    with pytest.raises(PickleNotAllowedError, match="'k'"):
        encode_value(v, "k")
    out = decode_value(encode_value(v, "k", allow_pickle=True), "k", allow_pickle=True)
    assert type(out) is type(v)


def test_a_large_masked_array_is_not_stored_as_a_tensor(tmp_path):
    # over 64 KiB a plain array is stored as a tensor (its bytes): a masked array would lose its mask there too
    import liferaft

    big = np.ma.masked_array(np.arange(20000.0), np.arange(20000) % 2 == 0)
    with pytest.raises(PickleNotAllowedError, match="'m'"):
        liferaft.save(str(tmp_path / "a"), {"m": big})
    liferaft.save(str(tmp_path / "b"), {"m": big}, options=liferaft.SaveOptions(allow_pickle=True))
    out = liferaft.read(str(tmp_path / "b"), options=liferaft.LoadOptions(allow_pickle=True))["m"]
    assert type(out) is np.ma.MaskedArray and (out.mask == big.mask).all()
