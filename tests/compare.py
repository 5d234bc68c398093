"""Deep equality of saved/loaded state trees for tests (tensors bit-exact, nan == nan)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from liferaft import Sharded


def assert_same(a: Any, b: Any, where: str = "state", ordered: bool = True) -> None:
    """Assert ``a`` and ``b`` hold the same values and types; ``ordered``: dict key order must match too."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype} {a.shape} != {b.dtype} {b.shape}"
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, Sharded):
        assert (a.global_shape, a.offsets) == (b.global_shape, b.offsets), where
        assert_same(a.local, b.local, f"{where}.local", ordered)
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        same_keys = list(a) == list(b) if ordered else set(a) == set(b)
        assert same_keys, f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", ordered)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}", ordered)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
