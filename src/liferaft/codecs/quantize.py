"""Opt-in lossy codec ``q8-block``: floating-point values as int8 with one float32 scale per group of values.

Meant for optimizer moments (Adam's exp_avg / exp_avg_sq), which tolerate 8-bit storage (as in 8-bit optimizers);
never chosen by default. Frame layout (little endian)::

    b"LRQ8" | u8 version=1 | u8 dtype code | u32 values | u32 group
           | float32 scales[ceil(values/group)] | int8 q[values]

A reader checks the header first (magic, version, dtype code, ``1 <= group <= MAX_GROUP``, the frame exactly as
long as its header says, ``values`` exactly the block's), so a frame never makes it allocate more than its own
size and one group. A value decodes to ``q × scale`` of its group (scale = max |x| / 127 over the group, 0 for an all-zero group),
cast back to the saved dtype. Non-finite values cannot be quantized: a block holding one is refused
(``encode`` raises CannotEncode and the writer stores that chunk raw instead). ``Q8Block`` is the codec
(``codecs.base``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

from liferaft.codecs.base import CannotEncode, Codec
from liferaft.errors import CorruptCheckpointError

MAGIC = b"LRQ8"
GROUP = 256
#: the largest group a frame may declare (a reader refuses more: the padding of one group is allocated)
MAX_GROUP = 1 << 16
_HEAD = struct.Struct("<4sBBII")
DTYPES = {"float32": (1, torch.float32), "bfloat16": (2, torch.bfloat16), "float16": (3, torch.float16),
          "float64": (4, torch.float64)}
_BY_CODE = {code: dt for code, dt in DTYPES.values()}


def encode(block: memoryview, dtype: str) -> bytes:
    """The q8 frame of ``block`` (raw values of ``dtype``, one of ``DTYPES``)."""
    code, tdt = DTYPES[dtype]
    x = torch.frombuffer(bytearray(block), dtype=tdt).float() if len(block) else torch.empty(0)
    n = x.numel()
    if not bool(torch.isfinite(x).all()):
        raise CannotEncode("block holds non-finite values")
    pad = (-n) % GROUP
    g = torch.nn.functional.pad(x, (0, pad)).view(-1, GROUP)
    scale = g.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return _HEAD.pack(MAGIC, 1, code, n, GROUP) + scale.numpy().tobytes() + q.numpy().tobytes()


def _header(mv: memoryview, where: str) -> tuple[int, int, int]:
    """(dtype code, values, group) of a q8 frame, its structure checked: every length it declares lies within
    the frame and the group within ``MAX_GROUP``, so that what it allocates is bounded by the frame's size."""
    try:
        magic, version, code, n, group = _HEAD.unpack_from(mv, 0)
    except struct.error:
        raise CorruptCheckpointError(f"{where}: quantized frame too short ({len(mv)} bytes)") from None
    if magic != MAGIC or version != 1 or code not in _BY_CODE:
        raise CorruptCheckpointError(f"{where}: not a liferaft q8 frame (magic {magic!r}, v{version})")
    if not 1 <= group <= MAX_GROUP:
        raise CorruptCheckpointError(f"{where}: quantized frame declares groups of {group} values (1 to "
                                     f"{MAX_GROUP} allowed)")
    need = _HEAD.size + 4 * -(-n // group) + n
    if len(mv) != need:
        raise CorruptCheckpointError(f"{where}: quantized frame has {len(mv)} bytes, its header declares {need}")
    return code, n, group


def dequantize(frame: memoryview | bytes, where: str = "chunk") -> torch.Tensor:
    """The values a q8 frame decodes to, in their saved dtype. Raises CorruptCheckpointError for a malformed
    frame before allocating anything beyond the frame's size (and ``MAX_GROUP`` values)."""
    mv = memoryview(frame).cast("B")
    code, n, group = _header(mv, where)
    groups = -(-n // group)
    scale = torch.frombuffer(bytearray(mv[_HEAD.size:_HEAD.size + 4 * groups]), dtype=torch.float32) \
        if groups else torch.empty(0)
    q = torch.frombuffer(bytearray(mv[_HEAD.size + 4 * groups:]), dtype=torch.int8) if n else torch.empty(0)
    vals = torch.nn.functional.pad(q.float(), (0, groups * group - n)).view(-1, group) * scale[:, None]
    return vals.view(-1)[:n].to(_BY_CODE[code])


def decode(frame: memoryview, out: memoryview, dtype: str, where: str = "chunk") -> None:
    """Dequantize ``frame`` into ``out`` (the raw bytes of the block in ``dtype``). The frame must hold exactly
    ``out``'s values in ``dtype``: checked from its header, before anything is decoded."""
    mv = memoryview(frame).cast("B")
    code, n, _ = _header(mv, where)
    if dtype not in DTYPES or code != DTYPES[dtype][0] or n * DTYPES[dtype][1].itemsize != len(out):
        raise CorruptCheckpointError(f"{where}: quantized frame holds {n} {_BY_CODE[code]} values, the block "
                                     f"has {len(out)} bytes of {dtype}")
    vals = dequantize(mv, where)
    if len(out):
        torch.frombuffer(out, dtype=torch.uint8).copy_(vals.view(torch.uint8))


class Q8Block(Codec):
    """Codec ``q8-block`` (lossy, opt-in, floating-point dtypes): one q8 frame per hash block."""

    name = "q8-block"
    lossless = False
    dtypes = frozenset(DTYPES)
    params: Mapping[str, Any] = {"group": GROUP}
    max_expansion = 8           # n values of at most 8 bytes each take at least n bytes of the frame

    def encode_block(self, block: memoryview, dtype: str) -> bytes:
        return encode(block, dtype)

    def decode_block(self, frame: memoryview, out: memoryview, dtype: str, where: str) -> None:
        decode(frame, out, dtype, where)

    def error_bound(self, block: memoryview, dtype: str) -> float:
        """Half a quantization step of the largest group (max |x| / 254), plus the float32 arithmetic and the
        rounding of the cast back to ``dtype`` (its unit roundoff × max |x|; fp16 subnormals: 2^-25)."""
        if not len(block):
            return 0.0
        peak = float(torch.frombuffer(bytearray(block), dtype=DTYPES[dtype][1]).double().abs().max())
        unit = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}.get(dtype, 0.0)
        return peak * (1 / 254 + unit + 2.0 ** -21) + (2.0 ** -25 if dtype == "float16" else 0.0)
