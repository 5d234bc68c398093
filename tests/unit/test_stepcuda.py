"""tiers.stepcuda and the pieces it writes a record with, on the CPU: ``Slot.copy_in`` (torch's copy into the
slot's mapping, in pieces, each hashed by a streaming checksum) writes the same bytes and the same entry as the
training thread's ``write`` + ``tensor_entry``, and ``CudaCopies.drain`` turns a record's copies into entries the
reader verifies. The CUDA side (side streams, events, pinned memory, the background publish) runs on a GPU only:
``benchmarks/gpu_check.sh`` checks it bitwise there (kill and resume == uninterrupted)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from liferaft.codecs.checksum import digest, stream
from liferaft.errors import CorruptCheckpointError
from liferaft.tiers.stepcuda import CudaCopies
from liferaft.tiers.steprecord import RECORD_CHECKSUM, as_bytes, tensor_at, tensor_entry
from liferaft.tiers.stepslot import Slot

MIB = 1 << 20


@pytest.fixture
def root():
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="liferaft-cuda-")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32c"])
def test_a_stream_of_pieces_digests_as_the_whole(algo):
    data = os.urandom(3 * MIB + 17)
    for piece in (1, 4096, MIB, 5 * MIB):
        h = stream(algo)
        for i in range(0, len(data), piece):
            h.update(memoryview(data)[i:i + piece])
        assert h.hexdigest() == digest(data, algo)
    with pytest.raises(CorruptCheckpointError, match="unknown"):
        stream("md5")


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (1537, 1031)), (torch.bfloat16, (7,)),
                                         (torch.int64, (0, 3)), (torch.float64, (2, 3, 5))])
def test_copy_in_writes_what_write_writes_and_the_same_entry(root, dtype, shape):
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    a, b = Slot(root, "a"), Slot(root, "b")
    off = 4160
    n = t.numel() * t.element_size()
    for s in (a, b):
        s.reserve(off + n + 64)
        s.write(0, b"\xee" * (off + n + 64))        # (whatever was there before: every byte is overwritten)
    a.write(off, as_bytes(t))
    want = tensor_entry(off, t, as_bytes(t))
    h = stream(RECORD_CHECKSUM)
    b.copy_in(off, t, h.update, piece=MIB // 3)     # (pieces that cut elements in two)
    assert bytes(a.map[:off + n + 64]) == bytes(b.map[:off + n + 64])
    assert h.hexdigest() == want["digest"]
    b.map.close()                                   # no buffer export left behind by the copy
    b.map = None
    a.close()
    os.close(b.fd)


def test_copy_in_refuses_what_does_not_fit(root):
    s = Slot(root, "a")
    s.reserve(100)
    with pytest.raises(AssertionError):
        s.copy_in(s.capacity - 8, torch.zeros(4, dtype=torch.float32), lambda b: None)
    s.close()


class _Copied:
    """What a CUDA event of a finished copy answers (the copies below are CPU tensors, copied already)."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_drain_writes_the_copies_and_entries_a_reader_verifies_and_drops_unused_buffers(root):
    copies = CudaCopies()
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(300, 257, generator=g), torch.randn(5, generator=g).to(torch.float16), torch.zeros(0)]
    offs, pos = [], 64
    for t in grads:
        offs.append(pos)
        pos += (t.numel() * t.element_size() + 63) // 64 * 64
    f = Slot(root, "r")
    f.reserve(pos)
    done = _Copied()
    # the record's pinned buffers (generation 1), and one a layout before used at another offset
    pinned = {(o, tuple(t.shape), t.dtype): t.clone() for o, t in zip(offs, grads)}
    copies._pinned[1] = {**pinned, (1 << 30, (1,), torch.float32): torch.zeros(1)}
    copies._pinned[0] = {(8, (1,), torch.float32): torch.ones(1)}       # the other generation: untouched
    entries = [{} for _ in grads]
    for o, t, e in zip(offs, grads, entries):
        copies.pending.append((pinned[(o, tuple(t.shape), t.dtype)], done, o, e, torch.device("cpu")))
    copies.drain(f, copies.take(), 1)
    assert copies.pending == [] and done.waited == len(grads)
    payload = memoryview(f.map)[:pos]
    for t, e in zip(grads, entries):
        assert e == tensor_entry(e["off"], t, as_bytes(t))
        assert torch.equal(tensor_at(e, payload, f.path, RECORD_CHECKSUM), t)
    del payload
    assert set(copies._pinned[1]) == set(pinned) and len(copies._pinned[0]) == 1
    f.close()
