"""The sync load's copy path (``core/chunks/fused.py``): each group of hash blocks is verified and copied into
contiguous destinations while in cache; other destinations get the verified unit whole. Every combination
round-trips bit-exact: aligned and unaligned destinations, non-contiguous destination views, raw and
compressed chunks, O_DIRECT and the page cache, pieces that cut a copy anywhere; a truncated or corrupt data
file is a clear error naming the file."""

from __future__ import annotations

import os

import pytest
import torch

import liferaft
from liferaft.errors import CorruptCheckpointError
from liferaft.options import LoadOptions, SaveOptions
from liferaft.storage import PosixStorage


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(640, 1031, generator=g),                        # many blocks, odd row length
        "bf16": torch.randn(3, 70001, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (200003,), generator=g, dtype=torch.int8),
        "small": torch.randn(5, generator=g),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, w in want.items():
        assert got[k].shape == w.shape and got[k].dtype == w.dtype, k
        assert _bits(got[k]) == _bits(w), k


def _destinations(kind: str, ref: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Zeroed targets of ``kind``: fresh tensors, views at an unaligned offset into a larger buffer, or
    non-contiguous views (transposed storage, every other element); plus what keeps their storage alive."""
    out, keep = {}, []
    for k, w in ref.items():
        if kind == "fresh" or w.dim() == 0:
            out[k] = torch.zeros_like(w)
        elif kind == "unaligned":
            base = torch.zeros(w.numel() + 3, dtype=w.dtype)
            keep.append(base)
            out[k] = base[3:].view(w.shape)                                   # 3 elements off any alignment
        else:
            base = torch.zeros(*w.shape, 2, dtype=w.dtype)
            keep.append(base)
            out[k] = base[..., 1]                                              # stride 2 in the last dim
            assert w.numel() == 0 or not out[k].is_contiguous()
    return out, keep


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("compression", ["off", "on"])
@pytest.mark.parametrize("kind", ["fresh", "unaligned", "strided"])
def test_load_round_trips_bit_exact_for_every_destination_and_path(tmp_path, direct, compression, kind):
    ref = _state()
    liferaft.save(str(tmp_path / "ck"), ref, options=SaveOptions(block_size=64 << 10, compression=compression))
    dst, _keep = _destinations(kind, ref)
    liferaft.load(PosixStorage(str(tmp_path / "ck"), direct_io=direct), dst)
    _same(dst, ref)


@pytest.mark.parametrize("max_read", [4096, 96 << 10, 32 << 20])
def test_pieces_that_cut_copies_anywhere_round_trip(tmp_path, max_read):
    # small reads split chunks into units of a few blocks; pieces of whole blocks cut copies mid-row
    ref = _state(1)
    liferaft.save(str(tmp_path / "ck"), ref, options=SaveOptions(block_size=64 << 10, compression="off"))
    for atomic in (False, True):
        dst, _keep = _destinations("unaligned", ref)
        liferaft.load(str(tmp_path / "ck"), dst, options=LoadOptions(max_read_bytes=max_read, atomic=atomic))
        _same(dst, ref)


def test_resharding_boxes_into_slices_of_targets_round_trip(tmp_path):
    # a box of the saved tensor landing in a column slice of a bigger target: not contiguous, copied whole
    ref = {"w": torch.randn(300, 2000)}
    liferaft.save(str(tmp_path / "ck"), ref, options=SaveOptions(block_size=64 << 10))
    holder = torch.zeros(300, 2001)
    dst = {"w": holder[:, 1:]}
    liferaft.load(str(tmp_path / "ck"), dst)
    assert _bits(dst["w"]) == _bits(ref["w"]) and bool((holder[:, 0] == 0).all())


def _data_files(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(os.path.join(folder, "data")):
        found += [os.path.join(root, n) for n in names]
    assert found
    return found


@pytest.mark.parametrize("direct", [True, False])
def test_truncated_data_file_is_a_clear_error(tmp_path, direct):
    ref = _state(2)
    liferaft.save(str(tmp_path / "ck"), ref, options=SaveOptions(block_size=64 << 10, compression="off"))
    for f in _data_files(str(tmp_path / "ck")):
        os.truncate(f, os.path.getsize(f) // 2 + 123)
    dst, _keep = _destinations("fresh", ref)
    with pytest.raises(CorruptCheckpointError) as e:
        liferaft.load(PosixStorage(str(tmp_path / "ck"), direct_io=direct), dst)
    assert "truncated" in str(e.value) and ".bin" in str(e.value)


def test_corrupt_block_never_reaches_its_target(tmp_path):
    ref = {"w": torch.randn(1 << 20)}                                        # 4 MiB: 64 blocks of 64 KiB
    liferaft.save(str(tmp_path / "ck"), ref, options=SaveOptions(block_size=64 << 10, compression="off"))
    (f,) = _data_files(str(tmp_path / "ck"))
    start = os.path.getsize(f) - (4 << 20)                                   # (where the chunk starts in the file)
    with open(f, "r+b") as fh:                                               # flip a byte in block 40
        fh.seek(start + 40 * (64 << 10) + 17)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    dst = {"w": torch.zeros(1 << 20)}
    with pytest.raises(CorruptCheckpointError, match="block 40"):
        liferaft.load(str(tmp_path / "ck"), dst)
    flat = dst["w"].view(torch.uint8)
    assert bool((flat[40 * (64 << 10):] == 0).all())                         # nothing from the bad block on
