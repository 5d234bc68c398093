"""The fast paths of the manifest boundary (issue #16: 100,000 keys in seconds) keep every check: the one-pass
checks of the common tensor and chunk accept only what the full decoder accepts and build the same records;
``check_chunks_tile``'s answer for a whole chunk is the full sweep's; the cyclic GC is given back as it was; a
manifest reused within a command is reused only for the very same bytes. No timing is asserted here (the
linearity test is ``test_hostile_misuse.py::test_cli_commands_over_100k_keys``)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import liferaft
from liferaft.core import commit
from liferaft.errors import LiferaftError
from liferaft.format import manifest as M
from liferaft.format.jsonsafe import paused_gc
from liferaft.format.limits import MAX_INT
from liferaft.planning.geometry import _max_gap, byte_span, check_chunks_tile, numel
from liferaft.storage import PosixStorage
from liferaft.testing import tamper

FILE = "data/0123456789abcdef/r00000.bin"
FILES = {FILE: 4096, "../other/data/x/r00000.bin": 64}


def _chunk(**change) -> dict:
    c = {"offsets": [0, 0], "sizes": [2, 3], "file": FILE, "byte_offset": 64, "length": 24, "block_size": 16,
         "hashes": ["a", "b"]}
    c.update(change)
    return {k: v for k, v in c.items() if v is not _DROP}


_DROP = object()
_ODD = st.sampled_from([None, True, False, 0, 1, -1, 2, 3, 4, 16, 24, 64, 4096, 4097, MAX_INT, MAX_INT + 1, 2 ** 64,
                        1.0, 24.0, "24", "a", [], [0], [1], [2, 3], [0, 0], [0, 1], [True, 3], [2.0, 3], [0, -1],
                        [MAX_INT, 1], [2 ** 40, 2 ** 40, 0], ["a", "b"], ["a"], ["a", 1], {}, FILE,
                        "../other/data/x/r00000.bin", "data/other.bin", _DROP])
_FIELDS = ["offsets", "sizes", "file", "byte_offset", "length", "block_size", "hashes", "codec", "frames", "delta",
           "extra"]


def _slow_chunk(c, ndim, itemsize):
    try:
        return M._decode_chunk(c, "m", ndim, FILES, itemsize, None)
    except LiferaftError:
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(_FIELDS), _ODD, max_size=3), ndim=st.integers(0, 3),
       itemsize=st.sampled_from([1, 2, 4, 8]))
def test_fast_chunk_accepts_only_what_the_full_decoder_accepts(changes, ndim, itemsize):
    c = _chunk(**changes)
    fast = M._chunk_fast(c, ndim, FILES, itemsize)
    if fast is not None:
        assert fast == M._decode_chunk(c, "m", ndim, FILES, itemsize, None)


def test_fast_chunk_takes_the_common_case():
    c = _chunk()
    assert M._chunk_fast(c, 2, FILES, 4) == _slow_chunk(c, 2, 4) is not None
    for bad in [_chunk(sizes=[2, 0], length=0, hashes=[]), _chunk(codec="bytegroup-zstd", frames=[8, 8]),
                _chunk(file="data/../../x"), _chunk(length=True), _chunk(sizes=[2, 3.0])]:
        assert M._chunk_fast(bad, 2, FILES, 4) is None          # (the full decoder takes or names it)


_TENSOR_ODD = st.sampled_from([None, True, 1, -1, 0, "float32", "int8", "float128", "tensor", "numpy", "module", "k",
                               [], ["k"], ["k", 0], [0], [True], ["k"] * 101, [1], [2, 3], [0, 3], [2 ** 62, 4],
                               [3.0], list(range(1, 70)), [_chunk()], [_chunk(), _chunk()], [{}], {}, _DROP])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(["key", "path", "kind", "dtype", "shape", "chunks", "lossy",
                                                "per_rank"]), _TENSOR_ODD, max_size=3))
def test_fast_tensor_accepts_only_what_the_full_decoder_accepts(changes):
    t = {"key": "k", "path": ["k"], "kind": "tensor", "dtype": "float32", "shape": [2, 3], "chunks": [_chunk()]}
    t.update(changes)
    t = {k: v for k, v in t.items() if v is not _DROP}
    try:
        fast = M._tensor_fast(t, FILES, None, "m")
    except LiferaftError:
        fast = None                  # a chunk the full decoder refuses, named: the same error as without the fast path
        with pytest.raises(LiferaftError):
            M._decode_tensor(t, "m", FILES, None)
    if fast is not None:
        slow = M._decode_tensor({**t, "lossy": None}, "m", FILES, None)    # (an 7th field: the full decoder runs)
        assert fast == slow


def test_records_built_by_the_fast_path_are_the_dataclasses():
    rec = M._raw_chunk((0,), (1,), FILE, 0, 4, 64, ("h",), M.CHECKSUM_ALGO)
    assert rec == M.ChunkRecord((0,), (1,), FILE, 0, 4, 64, ("h",))
    assert set(vars(rec)) == {f.name for f in dataclasses.fields(M.ChunkRecord)}
    entry = M._plain_tensor("k", ("k",), "tensor", "float32", (1,), (rec,))
    assert entry == M.TensorEntry("k", ("k",), "tensor", "float32", (1,), (rec,))
    assert set(vars(entry)) == {f.name for f in dataclasses.fields(M.TensorEntry)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.length = 5                                                       # type: ignore[misc]


@pytest.mark.parametrize("shape, box", [((4, 3), ((0, 0), (4, 3))), ((), ((), ())), ((0, 3), ((0, 0), (0, 3))),
                                        ((4,), ((1,), (4,))), ((4,), ((0,), (3,))), ((-1,), ((0,), (-1,))),
                                        ((4, 3), ((0,), (4, 3))), ((4,), ((-1,), (4,)))])
def test_a_whole_chunk_answers_as_the_sweep_does(shape, box):
    fast = check_chunks_tile(shape, [box])
    sweep = check_chunks_tile(shape, iter([box]))                # (an iterator: the full sweep)
    assert (fast is None) == (sweep is None), (fast, sweep)


def test_paused_gc_gives_the_collector_back_as_it_was():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()                                # a program that disabled it keeps it disabled
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError), paused_gc():
        _ = 1 / 0
    assert gc.isenabled()


def test_a_manifest_is_reused_only_for_the_same_bytes(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"a": torch.ones(3), "b": {"c": torch.zeros(2, 2)}, "n": 1})
    first = commit.open_checkpoint(PosixStorage(path), reuse=True)
    assert commit.open_checkpoint(PosixStorage(path), reuse=True) is first
    assert commit.open_checkpoint(PosixStorage(path)) is not first                  # (without reuse: decoded anew)
    liferaft.save(path, {"a": torch.ones(3), "b": {"c": torch.zeros(2, 2)}, "n": 2},   # the same path, other bytes
                  options=liferaft.SaveOptions(overwrite=True))
    second = commit.open_checkpoint(PosixStorage(path), reuse=True)
    assert second is not first and [v.value for v in second.values] == [2]

    def bad_size(doc):
        doc["tensors"][0]["shape"] = [4]

    tamper.rewrite_manifest(path, bad_size)          # damaged (and re-sealed): refused, never the kept manifest
    with pytest.raises(LiferaftError):
        commit.open_checkpoint(PosixStorage(path), reuse=True)
    with pytest.raises(LiferaftError):
        liferaft.inspect(path)
    liferaft.release()
    assert commit._OPENED == []


def test_the_cli_reads_a_damaged_manifest_after_a_good_one_as_damaged(tmp_path, capsys):
    from liferaft.cli import main

    path = str(tmp_path / "ck")
    liferaft.save(path, {"a": torch.ones(3)})
    assert main(["inspect", path]) == 0
    name = next(n for n in os.listdir(path) if n.startswith("manifest-"))
    with open(os.path.join(path, name), "r+b") as f:            # the same size, one byte changed: the hash differs
        data = f.read()
        f.seek(0)
        f.write(data.replace(b'"a"', b'"b"', 1))
    capsys.readouterr()
    assert main(["inspect", path]) == 1
    assert "checksum" in capsys.readouterr().err
    json.loads(data)                                              # (the original was a manifest)


@pytest.mark.parametrize("box, sizes, max_read", [(((0, 0), (4, 3)), (4, 3), 48), (((0, 0), (4, 3)), (4, 3), 47),
                                                  (((0,), (5,)), (5,), 1 << 20), (((0, 0), (2, 3)), (4, 3), 48),
                                                  (((), ()), (), 8)])
def test_a_whole_chunk_is_read_as_the_split_reads_it(box, sizes, max_read):
    from liferaft.planning.geometry import split_for_reading

    got = split_for_reading(box, sizes, 4, 16, max_read)
    stack, want = [box], []
    while stack:                                          # what the general split makes of it
        b = stack.pop()
        lo, hi = byte_span(b, sizes, 4)
        if (hi - lo <= max_read and _max_gap(b, sizes, 4) < 16) or numel(b[1]) <= 1:
            want.append(b)
            continue
        d = next(i for i, s in enumerate(b[1]) if s > 1)
        half = b[1][d] // 2
        o, s = list(b[0]), list(b[1])
        stack.append((tuple(o[:d] + [o[d] + half] + o[d + 1:]), tuple(s[:d] + [s[d] - half] + s[d + 1:])))
        stack.append((tuple(o), tuple(s[:d] + [half] + s[d + 1:])))
    assert got == want
