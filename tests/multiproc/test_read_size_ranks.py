"""The ranks of a load agree on one read size (``core.open``): where ``LoadOptions.max_read_bytes`` is None each
takes the smallest ``Storage.read_size`` of the ranks, so ranks reading one checkpoint from a disk (8 MiB) and
from a copy in RAM (4 MiB) plan their reads and the host's shared spans alike. Before, they planned apart and
waited for each other's messages until the timeout."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
from multiproc import _read_size_ranks as R

from liferaft.core.chunks.shm import SHARED_READ_SIZE
from liferaft.storage import memfs
from liferaft.testing import run_ranks


@pytest.fixture
def copies(tmp_path):
    if memfs.in_memory(str(tmp_path)) or not (os.path.isdir("/dev/shm") and memfs.in_memory("/dev/shm")):
        pytest.skip("needs a disk folder and /dev/shm in RAM")
    disk = str(tmp_path / "ck")
    run_ranks(R.save_rows, 2, disk, timeout=150.0)
    ram = f"/dev/shm/liferaft-test-{uuid.uuid4().hex}"
    shutil.copytree(disk, ram)
    yield disk, ram
    shutil.rmtree(ram, ignore_errors=True)


@pytest.mark.parametrize("layout", ["full", "cols"])
def test_ranks_on_storages_of_different_read_sizes_agree(copies, layout):
    disk, ram = copies
    out = run_ranks(R.load, 2, [ram, disk], [None, None], layout, timeout=150.0)
    assert all(o[0] == "ok" and o[1] for o in out), out


def test_a_default_and_the_same_explicit_size_agree(copies):
    disk, _ = copies
    out = run_ranks(R.load, 2, [disk, disk], [None, SHARED_READ_SIZE], "cols", timeout=150.0)
    assert all(o[0] == "ok" and o[1] for o in out), out
    out = run_ranks(R.load, 2, [disk, disk], [None, 4 << 20], "cols", timeout=150.0)
    assert all(o[0] == "error" and "different strict= or LoadOptions" in o[2] for o in out), out


def test_large_hash_blocks_are_still_shared(tmp_path):
    # rows saved in 4 MiB hash blocks, loaded as columns: each rank needs every block; one reads, the other
    # receives through the host's memory (a first fix let reads grow to 8 blocks, past the slots' size: nothing
    # was shared, every block read by both ranks)
    if not (os.path.isdir("/dev/shm") and memfs.in_memory("/dev/shm")):
        pytest.skip("needs /dev/shm in RAM")
    path = str(tmp_path / "ck")
    run_ranks(R.save_rows, 2, path, 4 << 20, timeout=150.0)
    out = run_ranks(R.load, 2, [path, path], [None, None], "cols", timeout=150.0)
    assert all(o[0] == "ok" and o[1] for o in out), out
    assert sum(o[2] for o in out) >= 16 << 20, out


@pytest.fixture
def docker_shm():
    """A 64 MiB tmpfs, as Docker's default --shm-size (root only: skipped where it cannot be mounted)."""
    import subprocess
    import tempfile

    where = tempfile.mkdtemp(prefix="liferaft-64m-shm-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", where], capture_output=True)
    if done.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')[:200]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=False)
        os.rmdir(where)


def test_four_ranks_share_reads_in_a_64_mib_shm_at_the_default_read_size(tmp_path, docker_shm):
    """With a disk's read size at 16 MiB each reading rank's ring was 2 x 16 MiB: a host of 4 found no room in a
    64 MiB /dev/shm and every rank read everything itself (review helper-124); a load on several ranks reads at
    most ``SHARED_READ_SIZE`` at a time, whatever the storage's ``read_size`` (this test fails with it at 16)."""
    path = str(tmp_path / "ck")
    run_ranks(R.save_wide, 4, path, timeout=300.0)
    out = run_ranks(R.load_wide_in, 4, path, docker_shm, timeout=300.0)
    assert all(o["right"] and o["received"] > 0 and o["warned"] == [] for o in out), out
