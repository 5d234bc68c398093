"""Loads from storage held in RAM stream each unit through a small cache-resident buffer (core.chunks.memread):
bitwise equal to the device path, every block verified before it lands, truncation and damage named; which
folders are in RAM (storage.memfs)."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch

import liferaft
from liferaft.core.chunks import memread
from liferaft.errors import CorruptCheckpointError
from liferaft.storage.memfs import filesystem_of, in_memory
from liferaft.storage.posix import PosixStorage

TABLE = """\
22 1 0:20 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:23 / /dev/shm rw,nosuid shared:4 - tmpfs tmpfs rw
26 22 0:24 / /dev/shm/over rw shared:5 - ext4 /dev/vdb rw
27 22 0:25 / /my\\040ram rw shared:6 - ramfs none rw
bad line without a separator
"""


def test_the_file_system_of_a_path_is_that_of_its_longest_mount_point():
    assert filesystem_of("/dev/shm/x/y", TABLE) == "tmpfs"
    assert filesystem_of("/dev/shm", TABLE) == "tmpfs"
    assert filesystem_of("/dev/shmx", TABLE) == "ext4"          # a name that only begins like a mount point
    assert filesystem_of("/dev/shm/over/a", TABLE) == "ext4"    # mounted over a RAM folder: not in RAM
    assert filesystem_of("/my ram/ckpt", TABLE) == "ramfs"      # octal escapes in mount points
    assert filesystem_of("/work", TABLE) == "ext4"
    assert filesystem_of("/x", "") is None


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm") or not in_memory("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    path = os.path.join("/dev/shm", f"liferaft-memread-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, 257, generator=g), "b": torch.randint(0, 255, (3000,), dtype=torch.uint8,
                                                                        generator=g),
            "c": torch.randn(64, 64, generator=g).double(), "step": 7}


def _zeros(st):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in st.items()}


@pytest.mark.parametrize("piece", [4096, 64 << 10, memread.PIECE])
def test_a_load_from_ram_is_streamed_and_bitwise(shm_dir, monkeypatch, piece):
    st = _state()
    liferaft.save(shm_dir, st, options=liferaft.SaveOptions(compression="off", block_size=8192))
    assert PosixStorage(shm_dir).memory_speed
    calls = []
    real = memread.stream_units
    monkeypatch.setattr("liferaft.core.chunks.reader.stream_units",
                        lambda s, items, piece=piece: calls.append(len(items)) or real(s, items, piece))
    got = _zeros(st)
    res = liferaft.load(shm_dir, got)
    assert calls and calls[0] >= 3                  # every tensor streamed
    assert res.bytes_read == sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    for k in st:
        assert torch.equal(got[k], st[k]) if isinstance(st[k], torch.Tensor) else got[k] == st[k]


def test_strided_destinations_and_slices_still_load_bitwise(shm_dir):
    st = {"a": torch.randn(64, 96)}
    liferaft.save(shm_dir, st, options=liferaft.SaveOptions(compression="off"))
    dest = torch.zeros(96, 64).t()                  # a non-contiguous destination: the device path's copy_
    liferaft.load(shm_dir, {"a": dest})
    assert torch.equal(dest, st["a"])
    half = liferaft.Sharded(torch.zeros(32, 96), (64, 96), (32, 0))    # a slab: a contiguous part of a chunk
    liferaft.load(shm_dir, {"a": half})
    assert torch.equal(half.local, st["a"][32:])


def _data_file(path: str) -> str:
    data = os.path.join(path, "data")
    sub = os.path.join(data, os.listdir(data)[0])
    return os.path.join(sub, os.listdir(sub)[0]) if os.path.isdir(sub) else sub


def test_a_flipped_byte_in_ram_is_refused_and_its_block_never_lands(shm_dir):
    st = {"a": torch.arange(64 * 1024, dtype=torch.float32)}
    liferaft.save(shm_dir, st, options=liferaft.SaveOptions(compression="off", block_size=4096))
    f = _data_file(shm_dir)
    with open(f, "r+b") as fh:                      # a byte in the 3rd block (bytes 8192..12288)
        fh.seek(9000)
        b = fh.read(1)
        fh.seek(9000)
        fh.write(bytes([b[0] ^ 0x10]))
    got = {"a": torch.full((64 * 1024,), -1.0)}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in block 2"):
        liferaft.load(shm_dir, got)
    assert torch.equal(got["a"][2048:3072], torch.full((1024,), -1.0))      # the damaged block: not loaded


def test_a_file_truncated_in_ram_is_named(shm_dir):
    st = {"a": torch.randn(1 << 16)}
    liferaft.save(shm_dir, st, options=liferaft.SaveOptions(compression="off"))
    f = _data_file(shm_dir)
    size = os.path.getsize(f)
    got = {"a": torch.zeros(1 << 16)}
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CorruptCheckpointError) as e:
        memread.stream_units(PosixStorage(shm_dir), [])     # nothing to do: nothing read
        liferaft.load(shm_dir, got)
    assert "truncated" in str(e.value) or "bytes" in str(e.value)


def test_the_in_process_store_streams_too():
    st = _state(1)
    url = f"memory://memread-{uuid.uuid4().hex[:8]}/ck"
    liferaft.save(url, st, options=liferaft.SaveOptions(compression="off"))
    got = _zeros(st)
    liferaft.load(url, got)
    assert all(torch.equal(got[k], st[k]) for k in ("a", "b", "c"))


def test_a_load_from_many_files_in_ram_keeps_few_open(shm_dir, monkeypatch):
    """A load reading from more files than the descriptors the process may still open (a long incremental chain,
    many ranks' files) streams them like a disk load does: at most MAX_OPEN open at once, bitwise equal."""
    import resource

    monkeypatch.setattr(memread._Files, "MAX_OPEN", 4)      # (the chain below reads from ~20 data files)
    st = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(48)}   # 1 MiB each
    for i in range(len(st)):       # every step changes one tensor: the last one reads from every step's files
        st[f"t{i}"] += 1
        liferaft.save(os.path.join(shm_dir, f"s{i:03d}"), st, options=liferaft.SaveOptions(
            incremental_base=f"s{i - 1:03d}" if i else None))
    last = os.path.join(shm_dir, f"s{len(st) - 1:03d}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 12, hard))
    try:
        got = {k: torch.zeros_like(v) for k, v in st.items()}
        liferaft.load(last, got)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert all(torch.equal(got[k], st[k]) for k in st)
