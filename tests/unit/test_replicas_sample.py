"""The sample a save hashes to compare the copies of a DTensor replicated by its sub-mesh alone
(``core.replicas.sample_digest``): equal copies agree whatever their strides, the box's offsets count, a
difference in the first, middle or last row is seen; a difference elsewhere is not (the sample tells different
tensors apart, pipeline stages naming their layers alike, not bit-level divergence of true replicas)."""

from __future__ import annotations

import pytest
import torch

from liferaft.core.replicas import SAMPLE_BYTES, sample_digest


def test_equal_copies_agree_and_the_offsets_count():
    a = torch.randn(2, 100_000)[:, ::2]                     # (strided: sampled without copying the box)
    assert sample_digest(a, (0, 0)) == sample_digest(a.contiguous(), (0, 0))
    assert sample_digest(a, (0, 0)) != sample_digest(a, (2, 0))
    assert sample_digest(torch.tensor(3.0), ()) != sample_digest(torch.tensor(4.0), ())
    assert sample_digest(torch.zeros(0, 5), (0, 0)) == sample_digest(torch.zeros(0, 5), (0, 0))


def test_a_difference_in_a_sampled_row_is_seen_and_elsewhere_not():
    base = torch.randn(1000, 64)
    for row in (0, 500, 999):
        other = base.clone()
        other[row, 3] += 1
        assert sample_digest(base, (0, 0)) != sample_digest(other, (0, 0)), row
    other = base.clone()
    other[250, 3] += 1
    assert sample_digest(base, (0, 0)) == sample_digest(other, (0, 0))
    wide = torch.randn(3, SAMPLE_BYTES)                     # (a leading corner of each row)
    changed = wide.clone()
    changed[1, 0] += 1
    assert sample_digest(wide, (0, 0)) != sample_digest(changed, (0, 0))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn, torch.bfloat16])
def test_every_dtype_is_sampled_and_a_1d_box_in_three_windows(dtype):
    x = torch.arange(40).to(dtype)
    assert sample_digest(x, (0,)) == sample_digest(x.clone(), (0,))
    y = torch.arange(100_000, dtype=torch.float32)
    z = y.clone()
    z[50_000] += 1                                          # (in the middle window)
    assert sample_digest(y, (0,)) != sample_digest(z, (0,))
