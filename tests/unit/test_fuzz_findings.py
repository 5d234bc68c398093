"""Regressions for what the fuzzing suite (tests/fuzz) found in sealed (re-signed) manifests, each a class of input."""

from __future__ import annotations

import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.errors import CorruptCheckpointError
from liferaft.testing import tamper


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"model": {"w": torch.arange(6.0), "u": torch.ones(2, dtype=torch.uint8)},
                         "meta": {"step": 3}})
    return path


def _set_path(section: str, index: int, path: list):
    def edit(doc):
        doc[section][index]["path"] = path
    return edit


@pytest.mark.parametrize("section,path", [
    ("tensors", [2**63 - 1, "w"]),      # the tensor vanished from read's tree and convert --to torch hit a KeyError
    ("tensors", [0, "w"]),              # read put it under "0.w" while inspect said "model.w"
    ("tensors", ["model", "other"]),
    ("values", ["meta", "step"]),
])
def test_key_must_be_its_path_joined(ckpt, capsys, section, path):
    """FORMAT.md §7: a key is its path's parts joined by '.'; a sealed manifest whose key and path disagree is
    corrupt (read and export otherwise disagreed on where the leaf lies)."""
    tamper.rewrite_manifest(ckpt, _set_path(section, 0, path))
    for fn in (liferaft.read, liferaft.inspect, liferaft.verify):
        with pytest.raises(CorruptCheckpointError, match="joined"):
            fn(ckpt)
    capsys.readouterr()
    assert main(["convert", ckpt, ckpt + ".pt", "--to", "torch"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "joined" in err


def test_keys_with_dots_in_a_dict_key_still_round_trip(tmp_path):
    path = str(tmp_path / "ck")
    state = {"a.b": torch.arange(3), "c": {"d.e": 5}}
    liferaft.save(path, state)
    back = liferaft.read(path)
    assert torch.equal(back["a.b"], state["a.b"]) and back["c"] == {"d.e": 5}


def test_a_node_without_a_container_entry_keeps_what_lies_under_it(ckpt):
    """A sealed manifest whose container ``model`` is recorded at ``["model", "model"]`` instead: read dropped the
    whole ``model`` subtree (build_tree attached only direct children); now every tensor the manifest declares
    comes back."""
    def edit(doc):
        c = next(c for c in doc["containers"] if c["path"] == ["model"])
        c["path"] = ["model", "model"]
    tamper.rewrite_manifest(ckpt, edit)
    tree = liferaft.read(ckpt)
    assert torch.equal(tree["model"]["w"], torch.arange(6.0)) and tree["model"]["model"] == {}
    assert {t.key for t in liferaft.inspect(ckpt).tensors} == {"model.w", "model.u"}
