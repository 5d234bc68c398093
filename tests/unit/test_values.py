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
