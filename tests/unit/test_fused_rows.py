"""A strided box of a resharding load (``core/chunks/fused.py``) is copied row by row as the verified bytes grow:
bit-exact for any box of a real checkpoint, and no row whose bytes reach a corrupt block ever lands in the
target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import liferaft
from liferaft import CorruptCheckpointError, Sharded
from liferaft.core.chunks import fused
from liferaft.planning.load_plan import CopySpec
from liferaft.testing.tamper import read_manifest

SENTINEL = -7.0


def _save(path: Path, full: torch.Tensor, block: int = 16384) -> None:
    liferaft.save(path, {"w": full}, options=liferaft.SaveOptions(compression="off", block_size=block))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 300), cols=st.integers(2, 90), depth=st.integers(1, 3), data=st.data())
def test_any_box_of_a_saved_tensor_loads_bit_exact(tmp_path_factory, rows, cols, depth, data):
    path = tmp_path_factory.mktemp("box") / "ck"
    shape = (rows, cols, depth)
    full = torch.randn(shape)
    _save(path, full, block=4096)
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    size = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, lo)]
    local = torch.full(size, SENTINEL)
    liferaft.load(path, {"w": Sharded(local, shape, tuple(lo))})
    want = full[lo[0]:lo[0] + size[0], lo[1]:lo[1] + size[1], lo[2]:lo[2] + size[2]]
    assert torch.equal(local, want)


@pytest.mark.parametrize("bad_block", [0, 64, 128, 201])
def test_no_row_reaching_a_corrupt_block_lands(tmp_path, bad_block):
    # 1000-byte rows straddling 16 KiB blocks; 250 blocks, verified in pieces of fused.PIECE (64 blocks)
    rows, cols, block = 4096, 250, 16384
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    path = tmp_path / "ck"
    _save(path, full, block)
    doc, _ = read_manifest(path)
    (c,) = next(t for t in doc["tensors"] if t["key"] == "w")["chunks"]
    assert c["block_size"] == block and c["length"] == rows * cols * 4
    with open(path / c["file"], "r+b") as f:
        at = c["byte_offset"] + bad_block * block + 100      # (in the box, columns 100..199, of a row that
        f.seek(at)                                           #  begins before the block)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    local = torch.full((rows, 100), SENTINEL)
    with pytest.raises(CorruptCheckpointError, match=f"block {bad_block}"):
        liferaft.load(path, {"w": Sharded(local, (rows, cols), (0, 100))})
    first_bad_row = bad_block * block // (cols * 4)
    assert bool((local[first_bad_row:] == SENTINEL).all())       # nothing at or past the bad block
    # the rows verified before the piece holding the bad block landed, whole
    piece = fused.PIECE // block * block
    before = bad_block * block // piece * piece // (cols * 4) - 1
    assert torch.equal(local[:max(before, 0)], full[:max(before, 0), 100:200])


def test_rows_fit_only_boxes_inside_the_unit_with_positive_strides():
    ok = CopySpec(target=0, dest_offsets=(0, 0), sizes=(4, 3), src_offset=2, src_strides=(10, 1))
    assert fused._Rows.fits(ok, (2 + 3 * 10 + 2 + 1) * 4, 4)
    assert not fused._Rows.fits(ok, (2 + 3 * 10 + 2 + 1) * 4 - 1, 4)                  # last element outside
    assert not fused._Rows.fits(CopySpec(0, (0, 0), (1, 3), 0, (10, 1)), 400, 4)      # one row
    assert not fused._Rows.fits(CopySpec(0, (0,), (4,), 0, (1,)), 400, 4)              # 1-D: a contiguous run
    assert not fused._Rows.fits(CopySpec(0, (0, 0), (4, 3), 0, (0, 1)), 400, 4)       # a stride of 0
    assert not fused._Rows.fits(CopySpec(0, (0, 0), (4, 3), -1, (10, 1)), 400, 4)     # before the unit


def test_targets_contiguous_but_for_size_one_dims_load(tmp_path):
    # is_contiguous() ignores size-1 dims, and reshape(-1) keeps their stride: such a view was taken for a run of
    # bytes and its byte view raised (from the review)
    full = torch.randn(4, 32768)
    liferaft.save(tmp_path / "a", {"w": full})
    column = torch.zeros(1, 4).t()                      # (4, 1), strides (1, 4)
    liferaft.load(tmp_path / "a", {"w": Sharded(column, (4, 32768), (0, 7))})
    assert torch.equal(column, full[:, 7:8])
    liferaft.save(tmp_path / "b", {"w": torch.tensor([1.5])})
    base = torch.zeros(2)
    one = base[::2]                                     # one element at a stride of 2
    liferaft.load(tmp_path / "b", {"w": one})
    assert base.tolist() == [1.5, 0.0]
