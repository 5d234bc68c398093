"""Hostile review of the tools, mended: ``diff`` is exact about container types between two liferaft checkpoints
and compares a value one side holds whole when ``keys`` selects its leaves; ``convert`` reads a ``torch.save``
file through the torch reader (refusing pickles and damage with liferaft's errors, keying a top-level list as the
reader does); an export refuses plain values holding numpy data that weights_only readers could not read back."""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile

import numpy as np
import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.core.open import open_reader
from liferaft.errors import CorruptCheckpointError, OptionsError, PickleNotAllowedError
from liferaft.tools.diff import value_difference


class _Evil:
    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


@pytest.fixture
def torch_files(tmp_path):
    """``torch.save`` files a convert must refuse: pickles running code (zip, legacy, a bare data.pkl in a zip),
    a truncated zip and legacy file, a deflated archive."""
    mark = str(tmp_path / "PWNED")
    good, legacy = tmp_path / "good.pt", tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(1000.)}, good)
    torch.save({"w": torch.ones(2), "s": 3}, legacy, _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(2), "e": _Evil(mark)}, tmp_path / "evil_zip.pt")
    torch.save({"w": torch.ones(2), "e": _Evil(mark)}, tmp_path / "evil_legacy.pt",
               _use_new_zipfile_serialization=False)
    with zipfile.ZipFile(tmp_path / "evil_pkl.pt", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Evil(mark), protocol=2))
        z.writestr("archive/version", "3\n")
    b = good.read_bytes()
    (tmp_path / "trunc_zip.pt").write_bytes(b[: len(b) // 2])
    (tmp_path / "trunc_legacy.pt").write_bytes(legacy.read_bytes()[:-20])
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(tmp_path / "deflated.pt", "w",
                                                       compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    return tmp_path, mark


@pytest.mark.parametrize("name,error", [("evil_zip.pt", PickleNotAllowedError),
                                        ("evil_legacy.pt", PickleNotAllowedError),
                                        ("evil_pkl.pt", PickleNotAllowedError),
                                        ("trunc_zip.pt", CorruptCheckpointError),
                                        ("trunc_legacy.pt", CorruptCheckpointError),
                                        ("deflated.pt", CorruptCheckpointError)])
def test_convert_from_a_hostile_torch_file_raises_liferaft_errors_naming_it(torch_files, name, error, capsys):
    root, mark = torch_files
    src = str(root / name)
    with pytest.raises(error, match=name):
        liferaft.convert(src, str(root / "out"), "liferaft")
    assert main(["convert", src, str(root / "out2"), "--to", "liferaft"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and name in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(mark) and not os.path.exists(root / "out") and not os.path.exists(root / "out2")


def test_convert_keys_a_top_level_list_as_the_torch_reader_does(tmp_path):
    src = str(tmp_path / "list.pt")
    torch.save([torch.ones(2), 5], src)
    assert sorted(open_reader(src).keys) == ["0", "1"]
    liferaft.convert(src, str(tmp_path / "ck"), "liferaft")
    back = liferaft.read(str(tmp_path / "ck"))
    assert isinstance(back, list) and torch.equal(back[0], torch.ones(2)) and back[1] == 5
    assert liferaft.diff(src, str(tmp_path / "ck")).identical
    liferaft.convert(src, str(tmp_path / "ck1"), "liferaft", keys=["1"])
    assert liferaft.read(str(tmp_path / "ck1")) == {"1": 5}


@pytest.mark.parametrize("x,y", [({1: "x"}, {"1": "x"}), ([1, 2], (1, 2)), ({0: "a", 1: "b"}, ["a", "b"]),
                                 ({"k": [1, (2, 3)]}, {"k": [1, [2, 3]]}), (torch.Size([2]), (2,))])
def test_diff_of_two_liferaft_checkpoints_is_exact_about_container_types(tmp_path, x, y):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    liferaft.save(a, {"w": torch.ones(1), "m": x})
    liferaft.save(b, {"w": torch.ones(1), "m": y})
    r = liferaft.diff(a, b)
    assert not r.identical and [(k.key, k.status) for k in r.changed()] == [("m", "changed")]
    assert value_difference(x, y) is None and value_difference(x, y, lenient=False)    # lenient: other formats
    liferaft.save(str(tmp_path / "a2"), {"w": torch.ones(1), "m": x})
    assert liferaft.diff(a, str(tmp_path / "a2")).identical


def test_diff_stays_lenient_where_one_side_does_not_record_container_types(tmp_path):
    lf, pt = str(tmp_path / "lf"), str(tmp_path / "x.pt")
    liferaft.save(lf, {"w": torch.ones(1), "m": {1: "x", 2: (1, 2)}})
    torch.save({"w": torch.ones(1), "m": {"1": "x", "2": [1, 2]}}, pt)
    assert liferaft.diff(lf, pt).identical and liferaft.diff(pt, lf).identical


@pytest.mark.parametrize("keys", [["opt.nested"], ["opt.nested.a"], ["opt.nested.*"], ["*.a"], ["opt"]])
def test_diff_keys_selecting_leaves_of_a_value_one_side_holds_whole_compare_the_whole_value(tmp_path, keys):
    import torch.distributed.checkpoint as dcp

    lf, same, other = str(tmp_path / "lf"), str(tmp_path / "same"), str(tmp_path / "other")
    liferaft.save(lf, {"w": torch.ones(3), "opt": {"lr": 0.1, "nested": {"a": 1}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "opt": {"lr": 0.1, "nested": {"a": 1}}}, checkpoint_id=same, no_dist=True)
        dcp.save({"w": torch.ones(3), "opt": {"lr": 0.1, "nested": {"a": 2}}}, checkpoint_id=other, no_dist=True)
    for a, b in [(lf, same), (same, lf)]:
        r = liferaft.diff(a, b, keys=keys)
        assert r.identical and [k.key for k in r.keys] == ["opt"]
    for a, b in [(lf, other), (other, lf)]:
        r = liferaft.diff(a, b, keys=keys)
        assert [(k.key, k.status) for k in r.keys] == [("opt", "changed")] and "['nested']['a']" in r.keys[0].detail
    assert [k.key for k in liferaft.diff(lf, other, keys=["w"]).keys] == ["w"]


@pytest.mark.parametrize("value,where", [(np.arange(3, dtype=np.int16), "key 'np' holds a numpy array"),
                                         (np.float32(0.5), "key 'np' holds a numpy scalar"),
                                         ({"a": [1, np.int64(2)]}, "key 'np' at ['a'][1] holds a numpy scalar"),
                                         ({np.int64(1): "x"}, "at (the dict key np.int64(1)) holds a numpy scalar")])
@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_export_refuses_numpy_plain_values_naming_the_key_and_writes_nothing(tmp_path, value, where, to):
    src = str(tmp_path / "src")
    liferaft.save(src, {"model": {"w": torch.ones(2, 2)}, "step": 3, "np": value})
    dst = str(tmp_path / ("o.pt" if to == "torch" else "o"))
    with pytest.raises(OptionsError, match=r"numpy .*weights_only.*nothing was written.*--key") as e:
        liferaft.convert(src, dst, to)
    assert where in str(e.value)
    assert not os.path.exists(dst) and os.listdir(tmp_path) == ["src"]
    liferaft.convert(src, dst, to, keys=["model", "step"])            # the way out the error names
    back = str(tmp_path / "back")
    liferaft.convert(dst, back, "liferaft")
    assert liferaft.diff(src, back, keys=["model", "step"]).identical and liferaft.diff(dst, back).identical


def test_export_refuses_any_value_weights_only_cannot_read_back(tmp_path):
    src = str(tmp_path / "src")
    liferaft.save(src, {"w": torch.ones(2), "f": frozenset({1, 2})})
    with pytest.raises(OptionsError, match="key 'f' holds a frozenset value that weights_only readers cannot read"):
        liferaft.convert(src, str(tmp_path / "o.pt"), "torch")
    assert not os.path.exists(tmp_path / "o.pt")
