"""``LoadOptions(ignore_keys=...)``: a strict load that leaves named checkpoint keys (a key or a dotted prefix)
unread without counting them as unexpected; a key of the state missing from the checkpoint is refused as before."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.errors import OptionsError, StateMismatchError


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"a": torch.arange(3.0), "b": {"x": torch.ones(2), "y": 7}, "bb": torch.zeros(1)})
    return path


def test_ignored_prefixes_only(ck):
    state = {"a": torch.zeros(3)}
    with pytest.raises(StateMismatchError, match="'bb'"):         # "b" is a prefix of keys, not of names
        liferaft.load(ck, state, options=liferaft.LoadOptions(ignore_keys=("b",)))
    assert torch.equal(state["a"], torch.zeros(3))                 # refused before anything was loaded
    result = liferaft.load(ck, state, options=liferaft.LoadOptions(ignore_keys=("b", "bb")))
    assert torch.equal(state["a"], torch.arange(3.0))
    assert set(result.unexpected_keys) == {"b.x", "b.y", "bb"}


def test_a_missing_key_is_still_refused(ck):
    state = {"a": torch.zeros(3), "c": torch.zeros(1)}
    with pytest.raises(StateMismatchError, match="'c'"):
        liferaft.load(ck, state, options=liferaft.LoadOptions(ignore_keys=("b", "bb", "c")))
    assert torch.equal(state["a"], torch.zeros(3))


@pytest.mark.parametrize("bad", [["b"], ("",), (1,), "b"])
def test_bad_values_are_refused(bad):
    with pytest.raises(OptionsError, match="ignore_keys"):
        liferaft.LoadOptions(ignore_keys=bad)
