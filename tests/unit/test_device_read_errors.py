"""A device that fails a read (a real EIO from the kernel: an ext4 file system on a loop device whose image is
shrunk under it) is a FileAccessError (a LiferaftError and an OSError with errno EIO) naming the data file, the
bytes and what to do, from every read path of a load, not a raw OSError. Root only: skipped where a loop device
cannot be set up."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

import liferaft
from liferaft.errors import FileAccessError, LiferaftError
from liferaft.storage import PosixStorage


class FailingDisk:
    def __init__(self, image: str, mount: str, loop: str) -> None:
        self.image, self.mount, self.loop = image, mount, loop

    def fail(self) -> None:
        """Every block past the first 8 MiB of the device reads as an I/O error from now on."""
        os.truncate(self.image, 8 << 20)
        subprocess.run(["losetup", "-c", self.loop], check=True, capture_output=True)


@pytest.fixture
def failing_disk(tmp_path) -> Iterator[FailingDisk]:
    image, mount = str(tmp_path / "disk.img"), str(tmp_path / "mnt")
    os.mkdir(mount)
    with open(image, "wb") as f:
        f.truncate(96 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True)
    loop = subprocess.run(["losetup", "-f", "--show", image], capture_output=True, text=True)
    if made.returncode or loop.returncode:
        pytest.skip(f"no loop device here: {(made.stderr or b'').decode()[:100]} {loop.stderr[:100]}")
    dev = loop.stdout.strip()
    try:
        if subprocess.run(["mount", dev, mount], capture_output=True).returncode:
            pytest.skip("cannot mount a loop device here")
        try:
            yield FailingDisk(image, mount, dev)
        finally:
            if subprocess.run(["umount", mount], capture_output=True).returncode:
                subprocess.run(["umount", "-l", mount], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def _data_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(os.path.join(root, "data")) for n in names]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_a_device_read_error_is_a_clear_liferaft_error(failing_disk, direct):
    root = os.path.join(failing_disk.mount, "ck")
    state = {"w": torch.randn(10 << 20 >> 2), "b": torch.randn(6 << 20)}      # 10 + 24 MiB: past 8 MiB on disk
    liferaft.save(root, state, options=liferaft.SaveOptions(compression="off"))
    for d, _, names in os.walk(root):                                        # metadata and small files cached
        for n in names:
            path = os.path.join(d, n)
            fd = os.open(path, os.O_RDONLY)
            try:
                if path not in _data_files(root):
                    os.read(fd, 1 << 20)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED if path in _data_files(root) else 0)
            finally:
                os.close(fd)
    failing_disk.fail()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(FileAccessError) as got:
        liferaft.load(PosixStorage(root, direct_io=direct), target)
    e = got.value
    assert isinstance(e, LiferaftError) and isinstance(e, OSError) and e.errno == errno.EIO
    assert "data/" in str(e) and ".bin" in str(e) and "I/O error" in str(e) and "another copy" in str(e), str(e)


def test_restore_falls_back_past_a_step_the_device_cannot_read(failing_disk):
    # what CheckpointManager.restore runs over its steps (``first_that_loads``): the newer step's data is read
    # from the failing device, the older step's from the page cache (read once before the device fails; a
    # load reads cached data through the cache); the restore warns about the newer one and takes the older
    from liferaft.dist import Coordinator
    from liferaft.manager.tiering import first_that_loads

    small, big = {"w": torch.randn(1 << 16)}, {"w": torch.randn(1 << 16), "extra": torch.randn(10 << 20)}
    paths = {1: os.path.join(failing_disk.mount, "step-1"), 2: os.path.join(failing_disk.mount, "step-2")}
    liferaft.save(paths[1], small, options=liferaft.SaveOptions(compression="off"))
    liferaft.save(paths[2], big, options=liferaft.SaveOptions(compression="off"))
    for path in _data_files(paths[2]):                                       # (cold: read from the device)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for path in _data_files(paths[1]):                                       # (hot: in the page cache)
        with open(path, "rb") as f:
            f.read()
    failing_disk.fail()
    target = {"w": torch.zeros(1 << 16)}
    with pytest.warns(UserWarning, match=r"step 2 .*I/O error.*trying step 1"):
        step, _ = first_that_loads(Coordinator(None), [(2, paths[2]), (1, paths[1])],
                                   lambda s: liferaft.load(paths[s], target, strict=False), raise_last=True)
    assert step == 1 and torch.equal(target["w"], small["w"])
