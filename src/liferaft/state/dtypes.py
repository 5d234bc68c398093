"""Dtype names: liferaft's stored names (``"bfloat16"``) to torch dtypes and back."""

from __future__ import annotations

import torch

from liferaft.errors import CorruptCheckpointError


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
