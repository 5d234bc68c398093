"""Views of tensor memory as bytes, and dtype names."""

from __future__ import annotations

import torch

from liferaft.errors import CorruptCheckpointError


def host_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU copy-or-view of ``t`` and a byte memoryview of it (keep the tensor alive while used)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return t, memoryview(b"")
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
