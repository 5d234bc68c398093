"""Hostile review B of issue #16, each finding as a class: conversions that would destroy or write into what is
there, a quadratic chunk-tiling check, loads into destinations of two keys sharing memory, exotic tensors, tagged
values out of range, ``ls`` of a damaged root, and arguments echoed in errors. Real files, real processes."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft import CheckpointExistsError, CorruptCheckpointError, InvalidStateError, OptionsError
from liferaft.format.limits import MAX_CHUNKS_PER_TENSOR
from liferaft.options import check_path
from liferaft.planning.geometry import check_chunks_tile
from liferaft.testing import tamper


def cli(*args: str) -> subprocess.CompletedProcess:
    return liferaft_cli(*args, timeout=120)


@pytest.fixture
def ck(tmp_path):
    p = str(tmp_path / "ck")
    liferaft.save(p, {"w": torch.arange(6.), "b": torch.ones(3)})
    return p


@pytest.mark.parametrize("to", ["torch", "safetensors", "dcp", "hf"])
def test_convert_never_replaces_a_file_fifo_device_or_link_at_its_destination(tmp_path, ck, to):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    made = {"file": lambda p: p.write_text("mine"), "fifo": lambda p: os.mkfifo(p),
            "link": lambda p: os.symlink(victim, p), "dangling": lambda p: os.symlink(tmp_path / "none", p)}
    if os.geteuid() == 0:
        made["device"] = lambda p: os.mknod(p, 0o600 | 0o020000, os.makedev(1, 3))
    for kind, make in made.items():
        dst = tmp_path / f"{to}-{kind}"
        make(dst)
        before = os.lstat(dst)
        with pytest.raises(CheckpointExistsError, match="already exists|cannot be used"):
            liferaft.convert(ck, str(dst), to, module="" if to == "hf" else None)
        after = os.lstat(dst)
        assert (before.st_ino, before.st_mode) == (after.st_ino, after.st_mode), kind
    assert victim.read_text() == "precious"
    r = cli("convert", ck, str(tmp_path / f"{to}-file"), "--to", to)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "already exists" in r.stderr


@pytest.mark.parametrize("to", ["torch", "safetensors", "dcp", "hf"])
def test_convert_refuses_the_source_itself_a_place_inside_it_or_around_it(tmp_path, ck, to):
    before = sorted(os.listdir(ck))
    for dst in (ck, os.path.join(ck, "out"), str(tmp_path)):
        with pytest.raises(OptionsError, match="the source"):
            liferaft.convert(ck, dst, to, module="" if to == "hf" else None)
    os.symlink(ck, tmp_path / "alias")                              # the same folder by another name
    with pytest.raises(OptionsError, match="is the source"):
        liferaft.convert(ck, str(tmp_path / "alias"), to, module="" if to == "hf" else None)
    assert sorted(os.listdir(ck)) == before


def test_imports_refuse_a_destination_inside_the_source_folder_and_a_non_empty_folder(tmp_path, ck):
    st = tmp_path / "st"
    liferaft.convert(ck, str(st), "safetensors")
    with pytest.raises(OptionsError, match="inside the source"):
        liferaft.convert(str(st), str(st / "ck"), "liferaft")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    for to in ("liferaft", "dcp"):
        with pytest.raises(CheckpointExistsError, match="not empty"):
            liferaft.convert(str(st) if to == "liferaft" else ck, str(other), to)
    with pytest.raises(CheckpointExistsError, match="checkpoint"):        # a folder export never lands in a checkpoint
        liferaft.convert(str(st), ck, "safetensors", source="safetensors")
    assert sorted(os.listdir(other)) == ["notes.txt"]
    liferaft.convert(ck, str(st), "safetensors")                        # an earlier export: documented, replaced


def test_tiling_check_is_near_linear_for_chunks_disjoint_along_one_dimension():
    n = 20000                           # n chunks [n, 1] at (i, i): every one active in a sweep along dim 0
    boxes = [((i, i), (n, 1)) for i in range(n)]
    assert "cover" in check_chunks_tile((2 * n, n), boxes)
    assert check_chunks_tile((n, n), [((0, i), (n, 1)) for i in range(n)]) is None        # column shards
    grid = [((r * 4, c * 3), (4, 3)) for r in range(300) for c in range(300)]
    assert check_chunks_tile((1200, 900), grid) is None
    assert "overlap" in check_chunks_tile((1200, 900), grid[:-1] + [((4, 3), (4, 3))] + [((1196, 897), (4, 2))]) \
        or "cover" in check_chunks_tile((1200, 900), grid[:-1] + [((4, 3), (4, 3))])
    # not a grid: TP column blocks, each row-sharded differently; and a real overlap in such a layout
    mixed = [((0, 0), (4, 8)), ((4, 0), (4, 8)), ((0, 8), (2, 8)), ((2, 8), (6, 8))]
    assert check_chunks_tile((8, 16), mixed) is None
    assert "overlap" in check_chunks_tile((8, 16), mixed[:3] + [((1, 8), (6, 8)), ((7, 8), (1, 8))])
    too_many = [((i,), (1,)) for i in range(MAX_CHUNKS_PER_TENSOR + 1)]
    assert "more than" in check_chunks_tile((MAX_CHUNKS_PER_TENSOR + 1,), too_many)


def test_a_manifest_of_many_chunks_disjoint_along_one_dimension_is_refused_quickly(tmp_path):
    p = str(tmp_path / "q")
    n = 3000
    liferaft.save(p, {"t": torch.zeros(n, dtype=torch.uint8)})

    def edit(d):
        t = d["tensors"][0]
        t["shape"] = [2 * n, n]
        t["chunks"] = [dict(t["chunks"][0], offsets=[i, i], sizes=[n, 1]) for i in range(n)]
    tamper.rewrite_manifest(p, edit)
    with pytest.raises(CorruptCheckpointError, match="cover"):
        liferaft.inspect(p)


def test_load_refuses_destinations_of_two_keys_that_partially_share_memory(tmp_path):
    p = str(tmp_path / "ck")
    liferaft.save(p, {"a": torch.arange(6.), "b": torch.arange(4.) + 10, "c": torch.ones(3)})
    base = torch.full((20,), -1.0)
    other = torch.full((3,), -1.0)
    with pytest.raises(InvalidStateError, match="'a' and 'b'.*share memory"):
        liferaft.load(p, {"a": base[0:6], "b": base[2:6], "c": other})
    assert bool((base == -1).all()) and bool((other == -1).all())      # nothing written
    raw = torch.zeros(24, dtype=torch.uint8)                            # another dtype's view of the same bytes
    with pytest.raises(InvalidStateError, match="share memory"):
        liferaft.load(p, {"a": raw[:24].view(torch.float32), "b": raw[8:24].view(torch.float32), "c": other})
    inter = torch.zeros(12)                                             # interleaved, no element shared: fine
    st = {"a": inter[0::2], "b": inter[1::2][:4], "c": other}
    liferaft.load(p, st)
    assert torch.equal(st["a"], torch.arange(6.)) and torch.equal(st["b"], torch.arange(4.) + 10)


def test_load_refuses_boxes_of_one_sharded_that_share_memory(tmp_path):
    # two boxes of one key are different parts of the global tensor: any memory they share was written twice,
    # the later box over the earlier (found by fuzzing); boxes in separate memory still load
    p = str(tmp_path / "ck")
    liferaft.save(p, {"a": torch.arange(9.)})
    base = torch.full((9,), -1.0)
    for box0, box1 in [(base[:5], base[1:5]), (base[:4], base[:4])]:           # overlapping; the very same view
        with pytest.raises(InvalidStateError, match="'a': two of its boxes .* share memory"):
            liferaft.load(p, {"a": liferaft.Sharded(box0, (9,), (0,), more=[((5,), box1)])})
        assert bool((base == -1).all())
    apart = torch.full((9,), -1.0)
    liferaft.load(p, {"a": liferaft.Sharded(apart[:5], (9,), (0,), more=[((5,), apart[5:])])})
    assert torch.equal(apart, torch.arange(9.))


def test_load_into_tied_tensors_keeps_working(tmp_path):
    p = str(tmp_path / "tied")
    w = torch.randn(4, 3)
    liferaft.save(p, {"emb": w, "head": w})
    dst = torch.zeros(4, 3)
    st = {"emb": dst, "head": dst}
    liferaft.load(p, st)
    assert torch.equal(dst, w)
    view = torch.zeros(12)
    liferaft.load(p, {"emb": view.view(4, 3), "head": view.view(4, 3)})  # the same view, two objects
    assert torch.equal(view.view(4, 3), w)


class Wrapped(torch.Tensor):
    """A tensor subclass that intercepts torch operations."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [
    lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)]),
    lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)], layout=torch.jagged),
    lambda: torch.Tensor._make_subclass(Wrapped, torch.zeros(3)),
], ids=["nested", "jagged", "dispatch_subclass"])
def test_exotic_tensors_are_refused_naming_the_key_in_save_and_as_load_destinations(tmp_path, make):
    p = str(tmp_path / "ck")
    with pytest.raises(InvalidStateError, match="key 'x'"):
        liferaft.save(p, {"x": make()})
    liferaft.save(p, {"x": torch.zeros(3)})
    with pytest.raises(InvalidStateError, match="key 'x'"):
        liferaft.load(p, {"x": make()})


@pytest.mark.parametrize("tagged", [
    {"$torch_size": [2 ** 70]}, {"$torch_size": [-1]}, {"$torch_size": [2.5]}, {"$torch_size": [True]},
    {"$torch_size": "12"}, {"$bytes": "!!!"}, {"$bytes": 5}, {"$float": "1.5"}, {"$float": 1},
    {"$complex": [1]}, {"$complex": ["a", 1]}, {"$tuple": {"a": 1}}, {"$set": [[1]]}, {"$dict": [[1]]},
    {"$dict": "ab"}, {"$torch_dtype": "Tensor"}, {"$torch_dtype": 3},
    {"$ndarray": {"dtype": "<f4", "shape": [3], "data": "AAAA"}},
    {"$ndarray": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}},
    {"$ndarray": {"dtype": "<f4", "shape": [-1], "data": ""}},
    {"$ndarray": {"dtype": "<f4", "shape": [2 ** 62, 2 ** 62], "data": ""}},
    {"$npscalar": {"dtype": "<f8", "data": "AAAA"}}, {"$pickle": "!!"},
])
def test_every_tagged_value_is_checked_on_read(tmp_path, tagged):
    p = str(tmp_path / "v")
    liferaft.save(p, {"w": torch.ones(2), "s": torch.Size([2])})
    tamper.rewrite_manifest(p, lambda d: next(v for v in d["values"] if v["key"] == "s").update(value=tagged))
    with pytest.raises((CorruptCheckpointError, liferaft.PickleNotAllowedError), match="key 's'"):
        liferaft.read(p)


def test_ls_reports_a_damaged_pins_and_a_missing_root(tmp_path):
    root = tmp_path / "root"
    liferaft.save(str(root / "step-0000000001"), {"w": torch.ones(2)})
    (root / "PINS").write_text("[1, 1e400]")
    r = cli("ls", str(root))
    assert r.returncode == 1 and "committed" in r.stdout and "PINS" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = cli("ls", str(tmp_path / "missing"))
    assert r.returncode == 1 and "no such folder" in r.stderr and not r.stdout
    (tmp_path / "empty").mkdir()
    assert cli("ls", str(tmp_path / "empty")).returncode == 0


def test_arguments_are_named_and_echoed_short(tmp_path, ck):
    for dtype, why in (("foo", "unknown dtype"), ("int8", "not a floating-point")):
        r = cli("convert", ck, str(tmp_path / f"{dtype}.pt"), "--to", "torch", "--dtype", dtype)
        assert r.returncode == 1 and "--dtype" in r.stderr and why in r.stderr and "manifest" not in r.stderr
        assert not os.path.exists(tmp_path / f"{dtype}.pt")
    r = cli("plan", "--costs", str(tmp_path))
    assert r.returncode == 1 and str(tmp_path) in r.stderr and "Errno" not in r.stderr
    noconfig = tmp_path / "tree"
    (noconfig / "a" / "b").mkdir(parents=True)
    with pytest.raises(OptionsError, match="no config.json"):
        liferaft.convert(ck, str(tmp_path / "hf"), "hf", module="", config=str(noconfig))
    with pytest.raises(OptionsError) as e:
        check_path({str(i): i for i in range(100_000)}, "load(path=...)")
    assert len(str(e.value)) < 300 and "dict" in str(e.value)
