"""A stand-in for the CUDA layer of the per-step log's background publish (``tiers.stepcuda``), on the CPU: this
machine has no GPU. Every tensor of a record goes through ``CudaCopies`` as a CUDA tensor does — copied into its
generation's buffer at capture, its copy's "event" given by the caller, written, hashed and published by the
background thread — with real slot files, ranks and exchanges. ``benchmarks/gpu_check.sh`` runs the real path."""

from __future__ import annotations

from typing import Any

import torch

from liferaft.tiers import steplog


def copy_to_generation(copies: Any, t: torch.Tensor, off: int, gen: int, event: Any) -> dict:
    """``CudaCopies.enqueue`` of ``t`` (at record offset ``off``, pinned generation ``gen``): its entry, filled
    when the copy is drained."""
    key = (off, tuple(t.shape), t.dtype)
    pinned = copies._pinned[gen].get(key)
    if pinned is None:
        pinned = copies._pinned[gen][key] = torch.empty(t.shape, dtype=t.dtype)
    pinned.copy_(t)
    entry: dict = {}
    copies.pending.append((pinned, event, off, entry, torch.device("cpu")))
    return entry


def put_deferred(log: Any, t: torch.Tensor) -> dict:
    """``StepLog._put``, its CUDA branch for every tensor."""
    cur = log._cur
    off = cur["pos"]
    cur["pos"] = off + (t.numel() * t.element_size() + steplog.ALIGN - 1) // steplog.ALIGN * steplog.ALIGN
    cur["file"].reserve(cur["pos"])
    return log._cuda.enqueue(t, off, cur["gen"])
