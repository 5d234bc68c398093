"""Byte-group + zstd codec: exact round trips for every float width, raw fallback for noise, clear errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from liferaft.codecs.bytegroup import decode, encode
from liferaft.errors import CorruptCheckpointError

pytest.importorskip("zstandard")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_round_trip_is_exact_and_trained_like_weights_shrink(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(1000, 37, generator=g) * 0.02).to(dtype) if dtype != torch.int8 else \
        torch.randint(-3, 3, (1000, 37), generator=g, dtype=torch.int8)
    raw = t.view(torch.uint8).numpy().tobytes() if t.element_size() > 1 else t.numpy().tobytes()
    frame = encode(raw, t.element_size())
    assert decode(frame) == raw
    out = bytearray(len(raw))
    assert decode(frame, memoryview(out)) is None and bytes(out) == raw
    assert len(frame) < len(raw)                           # small weights: the exponent planes compress


def test_noise_is_stored_raw_not_expanded_and_odd_tails_survive():
    noise = os.urandom(100_003)                            # not a multiple of 4
    frame = encode(noise, 4)
    assert decode(frame) == noise and len(frame) <= len(noise) + 64
    assert decode(encode(b"", 2)) == b""


def test_damaged_frames_raise_naming_the_chunk():
    frame = bytearray(encode(np.zeros(4096, dtype=np.float32).tobytes(), 4))
    with pytest.raises(CorruptCheckpointError, match="key 'w'"):
        decode(bytes(frame[:-5]), where="key 'w'")
    frame[0] = ord("X")
    with pytest.raises(CorruptCheckpointError, match="not a liferaft byte-group frame"):
        decode(bytes(frame))


def test_a_frame_cut_short_or_lying_about_its_length_is_corrupt_not_a_raw_error():
    """(Before: a frame cut inside its plane table raised struct.error, and a length field damaged to 2^50 made
    ``decode`` try to allocate a petabyte.)"""
    raw = (np.random.default_rng(0).standard_normal(1024).astype(np.float32) * 0.02).tobytes()
    frame = encode(raw, 4)
    for cut in (3, 20, 30, len(frame) - 1):
        with pytest.raises(CorruptCheckpointError, match="key 'w'"):
            decode(frame[:cut], memoryview(bytearray(len(raw))), where="key 'w'")
    huge = bytearray(frame)
    huge[6:14] = (1 << 50).to_bytes(8, "little")
    with pytest.raises(CorruptCheckpointError):
        decode(bytes(huge))
    noise = bytearray(encode(os.urandom(4096), 4))          # every plane raw
    noise[6:14] = (1 << 50).to_bytes(8, "little")
    with pytest.raises(CorruptCheckpointError):
        decode(bytes(noise))
    bad_mode = bytearray(frame)
    bad_mode[14] = 7                                        # plane 0's mode: neither raw (0) nor zstd (1)
    with pytest.raises(CorruptCheckpointError, match="plane 0"):
        decode(bytes(bad_mode))
    with pytest.raises(CorruptCheckpointError, match="after its planes"):
        decode(frame + b"\0")
