"""Single-process save → load/read round trips, the same assertions on every backend."""

import numpy as np
import pytest
import torch

import liferaft


def test_read_keeps_saved_order_and_nesting(backend_path):
    state = {"z": 1, "a": {"y": torch.ones(2), "b": [torch.zeros(1), 5, (torch.ones(3), "s")]}, "m": torch.arange(3)}
    liferaft.save(backend_path, state)
    tree = liferaft.read(backend_path)
    assert list(tree) == ["z", "a", "m"] and list(tree["a"]) == ["y", "b"]
    assert isinstance(tree["a"]["b"], list) and isinstance(tree["a"]["b"][2], tuple)
    assert tree["a"]["b"][1] == 5 and tree["a"]["b"][2][1] == "s"
    assert torch.equal(tree["a"]["b"][2][0], torch.ones(3))
    assert list(liferaft.read(backend_path, keys=["a.b"])["a"]["b"][2]) != []


def test_noncontiguous_empty_scalar_and_odd_dtypes(backend_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "e": torch.empty(0, 3), "s": torch.tensor(3.5, dtype=torch.float64),
             "b": torch.tensor([True, False]), "h": torch.arange(5).to(torch.bfloat16),
             "c": torch.tensor([1 + 2j], dtype=torch.complex64)}
    liferaft.save(backend_path, state)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    into["t"] = torch.zeros(4, 6).t()              # load into a non-contiguous view too
    liferaft.load(backend_path, into)
    for k in state:
        assert torch.equal(into[k], state[k]), k


def test_values_in_tuples_and_numpy_leaves_are_replaced(backend_path):
    big = np.arange(20000, dtype=np.float64)
    state = {"pair": (torch.ones(2), 7), "arr": big, "blob": b"x" * 70000, "small": np.arange(3)}
    liferaft.save(backend_path, state)
    into = {"pair": (torch.zeros(2), 0), "arr": None, "blob": None, "small": None}
    liferaft.load(backend_path, into)
    assert into["pair"][1] == 7 and torch.equal(into["pair"][0], torch.ones(2))
    assert np.array_equal(into["arr"], big) and into["blob"] == b"x" * 70000
    assert np.array_equal(into["small"], np.arange(3))


def test_strict_false_loads_what_matches(backend_path):
    liferaft.save(backend_path, {"a": torch.ones(2), "b": 3})
    into = {"a": torch.zeros(2), "c": torch.zeros(1)}
    res = liferaft.load(backend_path, into, strict=False)
    assert res.missing_keys == ("c",) and res.unexpected_keys == ("b",)
    assert torch.equal(into["a"], torch.ones(2))


@pytest.mark.parametrize("atomic", [False, True])
def test_atomic_and_plain_loads_give_the_same_result(backend_path, atomic):
    state = {"w": torch.randn(300, 70), "v": {"k": "x"}}
    liferaft.save(backend_path, state, options=liferaft.SaveOptions(block_size=4096))
    into = {"w": torch.zeros(300, 70), "v": {"k": None}}
    res = liferaft.load(backend_path, into, options=liferaft.LoadOptions(atomic=atomic, max_read_bytes=16384))
    assert torch.equal(into["w"], state["w"]) and into["v"] == {"k": "x"}
    assert ("verify" in res.timings) == atomic
